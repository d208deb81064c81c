/* Attention of decode and prompt rows over the paged KV cache, for CPU; fp32 and bf16 instances of
 * paged_attention_impl.h. */
#include "paged_attention_impl.h"
#define RLSERVE_BF16
#include "paged_attention_impl.h"

/* The shapes every kernel in this library handles (fused_ops_impl.h's RoPE needs an even head
 * size and sizes its buffer for MAX_HEAD_DIM too); the model keeps its PyTorch path for others. */
int rlserve_paged_attention_limits(int64_t group, int64_t head_dim, int64_t block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_HEAD_DIM && head_dim % 2 == 0 && block_size <= MAX_BLOCK && group <= TILE_QUERIES;
}
