/* A decode step's decoder layers in one call, for CPU; fp32 and bf16 instances of decode_impl.h. */
#define DECODE_LAYER_PTRS 13
#include "decode_impl.h"
#define RLSERVE_BF16
#include "decode_impl.h"

int rlserve_decode_layer_ptrs(void) { return DECODE_LAYER_PTRS; }
