/* A row of attention scores to its softmax, in place: shared by the decode kernel
 * (cpu_decode_attention.c) and the float32 prefill kernel (cpu_prefill_attention_f32.c). Their
 * sources are built with -ffast-math, so the exp loop calls glibc's vector expf (libmvec). */
#ifndef KVSCALE_CPU_SOFTMAX_H
#define KVSCALE_CPU_SOFTMAX_H

#include <math.h>
#include <stdint.h>

/* Each of `rows` rows of n scores (row r at scores + r * n) to its softmax, in place. */
static inline __attribute__((always_inline)) void softmax_rows(float *scores, int rows, int n) {
    for (int r = 0; r < rows; r++) {
        float *row = scores + (int64_t)r * n;
        float peak = row[0];
        for (int t = 1; t < n; t++) peak = row[t] > peak ? row[t] : peak;
        float total = 0.0f;
        /* Weights below e^-70 of the peak count as 0 (they are below float32's precision of
         * the sum anyway). Without the cut a peaked row sends expf inputs below -87 into
         * libmvec's scalar fallback and leaves subnormal weights, a microcode assist each on
         * every later multiply: a decode layer with peaked scores took 3x as long. */
        #pragma omp simd reduction(+ : total)
        for (int t = 0; t < n; t++) {
            const float shifted = row[t] - peak;
            row[t] = shifted < -70.0f ? 0.0f : expf(shifted > -70.0f ? shifted : -70.0f);
            total += row[t];
        }
        const float inv = 1.0f / total;
        #pragma omp simd
        for (int t = 0; t < n; t++) row[t] *= inv;
    }
}

#endif
