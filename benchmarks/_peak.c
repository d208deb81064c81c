/* One core's instruction peaks: AVX-512 fp32 FMAs and AVX512_BF16 dot products (vdpbf16ps),
   twelve independent accumulators each, nothing read from memory. Prints "fp32 GFLOP/s bf16
   GFLOP/s". Their ratio bounds how much faster any bf16 kernel can be than an fp32 kernel that
   runs at its own peak (the bytes ratio is 2x as well); AMX, where present, is not measured. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define STEPS 50000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TWELVE(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)

__attribute__((target("avx512f,avx512bf16"))) static double fp32_gflops(void) {
    __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f), a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    double t = now();
    for (long n = 0; n < STEPS; n++) {
#define FMA(i) a[i] = _mm512_fmadd_ps(x, y, a[i]);
        TWELVE(FMA)
    }
    t = now() - t;
    float keep = 0;
    for (int i = 0; i < 12; i++) keep += _mm512_reduce_add_ps(a[i]);
    if (keep == 1.5f) puts("");  /* the sums are used, so the loop stays */
    return STEPS * 12.0 * 16 * 2 / t / 1e9;
}

__attribute__((target("avx512f,avx512bf16"))) static double bf16_gflops(void) {
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    double t = now();
    for (long n = 0; n < STEPS; n++) {
#define DOT(i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
        TWELVE(DOT)
    }
    t = now() - t;
    float keep = 0;
    for (int i = 0; i < 12; i++) keep += _mm512_reduce_add_ps(a[i]);
    if (keep == 1.5f) puts("");
    return STEPS * 12.0 * 32 * 2 / t / 1e9;
}

int main(void) {
    double f = 0, b = 0;
    for (int round = 0; round < 3; round++) {  /* best of 3, alternating */
        double fr = fp32_gflops(), br = bf16_gflops();
        f = fr > f ? fr : f;
        b = br > b ? br : b;
    }
    printf("%.1f %.1f\n", f, b);
    return 0;
}
