/* Projections of a few rows (decode at small batch), for CPU; fp32 and bf16 instances of
 * gemv_impl.h, their outputs shared over parallel.c's threads. */
#include "gemv_impl.h"
#define RLSERVE_BF16
#include "gemv_impl.h"
