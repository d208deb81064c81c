/* The element-wise steps between a decoder layer's matmuls, fused, for CPU; fp32 and bf16
 * instances of fused_ops_impl.h. */
#include "fused_ops_impl.h"
#define RLSERVE_BF16
#include "fused_ops_impl.h"
