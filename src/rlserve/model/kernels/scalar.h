/* Storage types of the kernels: each kernel body (the *_impl.h files) is compiled once per type,
 * with fp32 arithmetic inside. LD widens a stored value to float; ST narrows a float to storage
 * (round to nearest even for bf16). ROUND(x) = LD(ST(x)): where transformers rounds an
 * intermediate to the model dtype, the bf16 kernels do too, so tokens follow its bf16 forward. */
#ifndef RLSERVE_SCALAR_H
#define RLSERVE_SCALAR_H
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16; /* the upper half of an IEEE float */

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
#endif

/* Instantiation: a .c file includes its *_impl.h once per type with these set. */
#undef T
#undef NAME
#undef LD
#undef ST
#ifdef RLSERVE_BF16
#define T bf16
#define NAME(fn) fn##_bf16
#define LD(x) bf16_to_f32(x)
#define ST(x) f32_to_bf16(x)
#else
#define T float
#define NAME(fn) fn##_f32
#define LD(x) f32_load(x)
#define ST(x) f32_store(x)
#endif
#define ROUND(x) LD(ST(x))
