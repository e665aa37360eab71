/* What kvlab's native CPU kernels share: vector types, element loads and stores in each
 * dtype, e^x, and the thread pool (cpu_pool.c) that runs a call's tasks.
 *
 * kernels/cpu_build.py compiles cpu_pool.c, cpu_decode.c and cpu_prefill.c into one
 * library with  cc -O3 -march=native -shared -fPIC -pthread.
 * Dtypes: 0 float32, 1 bfloat16, 2 float16 (where the compiler has _Float16).
 */

#ifndef KVLAB_CPU_COMMON_H
#define KVLAB_CPU_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX__) /* splat_f, fma_f; bf16_bits: vcvtneps2bf16 */
#include <immintrin.h>
#endif

#if defined(__FLT16_MAX__)
#define KVLAB_HAVE_F16 1
#else
#define KVLAB_HAVE_F16 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { KVLAB_OK = 0, KVLAB_EARG = 1, KVLAB_ELEN = 2, KVLAB_ESLOT = 3, KVLAB_ENOMEM = 4 };

/* floats per vector: one 512-bit register with AVX-512, else one 256-bit register (AVX2;
 * wider vectors split in two no longer fit the kernels' tiles in its 16 registers) */
#if defined(__AVX512F__)
#define V 16
#else
#define V 8
#endif
#define MAX_HEAD_DIM 1024
#define MAX_HEADS 4096
#define MAX_THREADS 256     /* threads in one call, the caller's included */

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));
typedef uint32_t vu32 __attribute__((vector_size(V * 4)));
typedef uint16_t vu16 __attribute__((vector_size(V * 2)));
#if KVLAB_HAVE_F16
typedef _Float16 vh16 __attribute__((vector_size(V * 2)));
#endif

/* Unaligned vectors read and written in place. A memcpy into a vector variable may compile
 * to two 32-byte copies through the stack, and the 64-byte load that follows then waits
 * for them (store forwarding fails): a quarter of the prompt kernel's time on a Xeon. */
typedef float vf_mem __attribute__((vector_size(V * 4), aligned(4), may_alias));
typedef uint16_t vu16_mem __attribute__((vector_size(V * 2), aligned(2), may_alias));
static ALWAYS_INLINE vf load_f(const float *p) { return *(const vf_mem *)p; }
static ALWAYS_INLINE void store_f(float *p, vf x) { *(vf_mem *)p = x; }

/* x in every lane (one broadcast; (vf){0} + x would also add the zero, which a compiler
 * keeps, since 0 + -0 is +0) */
static ALWAYS_INLINE vf splat_f(float x) {
#if defined(__AVX512F__)
    return _mm512_set1_ps(x);
#elif defined(__AVX__) && V == 8
    return _mm256_set1_ps(x);
#else
    vf v;
    for (int i = 0; i < V; i++) v[i] = x;
    return v;
#endif
}

#if defined(__AVX512F__) || defined(__FMA__) /* fma_f is one instruction */
#define KVLAB_HAVE_FMA 1
#else
#define KVLAB_HAVE_FMA 0
#endif

/* acc + a b with one rounding (a fused multiply-add), written out rather than left to the
 * compiler, which contracts a b + c where it chooses: GCC 12 tuning for Zen 3
 * (-march=native there), which avoids chains of FMAs, fused the products of cpu_stream.c's
 * multi-row blocks and not of its one-row block, so a row's bits depended on the rows
 * beside it (-march=x86-64-v3 fused all of them). Without FMA instructions, fmaf per lane
 * (the same bits, slowly). */
static ALWAYS_INLINE vf fma_f(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, acc);
#elif KVLAB_HAVE_FMA
    return _mm256_fmadd_ps(a, b, acc); /* V is 8 */
#else
    for (int i = 0; i < V; i++) acc[i] = __builtin_fmaf(a[i], b[i], acc[i]);
    return acc;
#endif
}

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Runs work(ctx) on the calling thread and num_threads - 1 pool helpers at once, and
 * returns when all of them have returned: the first non-zero status any of them gave, else
 * 0. Each call's work takes its tasks from a shared counter in ctx. One call at a time. */
typedef int (*kvlab_work)(void *ctx);
int kvlab_run_parallel(int num_threads, kvlab_work work, void *ctx);
/* From now on, run on the OpenMP runtime whose GOMP_parallel this is (NULL: our own pool). */
void kvlab_use_openmp(void *gomp_parallel_entry);

/* Entry points one kernel file calls from another (cpu_layer.c runs a decode layer through
 * them), declared once here so that the compiler checks each definition against its use:
 * cpu_fused.c's elementwise ops, cpu_linear.c's AMX linear and cpu_stream.c's fp32 and
 * bf16 linears. */
int kvlab_add_rms_norm(void *h, int64_t h_stride, const void *delta, int64_t delta_stride,
                       const void *weight, void *out, int64_t out_stride, int64_t rows,
                       int hidden, float eps, int num_threads, int dtype);
int kvlab_silu_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride,
                   void *out, int64_t out_stride, int64_t rows, int inter, int num_threads,
                   int dtype);
int kvlab_rope(const void *x, int64_t x_stride, const void *cos, const void *sin,
               int64_t cs_stride, void *out, int64_t out_stride, int64_t rows, int heads,
               int head_dim, int num_threads, int dtype);
int kvlab_linear_amx(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *packed,
                     const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t n,
                     int64_t k, int num_threads);
int kvlab_stream_linear(const float *x, int64_t x_stride, int rows, const float *packed,
                        const float *bias, float *out, int64_t out_stride, int64_t n, int64_t k,
                        int num_threads);
int kvlab_stream_linear_bf16(const uint16_t *x, int64_t x_stride, int rows,
                             const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                             int64_t out_stride, int64_t n, int64_t k, int num_threads);

/* ---- element conversion --------------------------------------------------------- */

static ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline int dtype_ok(int dtype) {
    return dtype == DT_F32 || dtype == DT_BF16 || (dtype == DT_F16 && KVLAB_HAVE_F16);
}

/* Element i of an array of `dtype`, as fp32. */
static ALWAYS_INLINE float load(const void *base, int dtype, int64_t i) {
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
#if KVLAB_HAVE_F16
    if (dtype == DT_F16) return (float)((const _Float16 *)base)[i];
#endif
    return ((const float *)base)[i];
}

/* Elements i .. i + V - 1 of an array of `dtype`, as fp32 (any alignment). */
static ALWAYS_INLINE vf load_v(const void *base, int dtype, int64_t i) {
    vf x;
    if (dtype == DT_BF16) {
        const vu16 h = *(const vu16_mem *)((const uint16_t *)base + i);
        vu32 u = __builtin_convertvector(h, vu32) << 16;
        memcpy(&x, &u, sizeof x);
    }
#if KVLAB_HAVE_F16
    else if (dtype == DT_F16) {
        vh16 h;
        memcpy(&h, (const _Float16 *)base + i, sizeof h);
        x = __builtin_convertvector(h, vf);
    }
#endif
    else
        x = load_f((const float *)base + i);
    return x;
}

/* x rounded to bf16 (nearest even; NaN stays NaN), as fp32 bits */
static ALWAYS_INLINE vu32 bf16_bits(vf x) {
#if defined(__AVX512BF16__) && V == 16 /* one instruction: vcvtneps2bf16 */
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)x);
    return (vu32)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#endif
    const vu32 u = (vu32)x; /* elsewhere: the rounding in integer lanes */
    const vi nan = (vi)((u & 0x7fffffffu) > 0x7f800000u);
    const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (vu32)(((vi)rounded & ~nan) | ((vi)(u | 0x400000u) & nan));
}

static ALWAYS_INLINE vf round_bf16(vf x) { return (vf)bf16_bits(x); }

/* base[offset + i] = x[i] * mul for i < n, rounded to `dtype` (nearest even) */
static inline void store(void *base, int dtype, int64_t offset, const float *restrict x, float mul,
                  int n) {
    if (dtype == DT_F32) {
        float *dst = (float *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = x[i] * mul;
    } else if (dtype == DT_BF16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(x[i] * mul);
    }
#if KVLAB_HAVE_F16
    else if (dtype == DT_F16) {
        _Float16 *dst = (_Float16 *)base + offset;
        for (int i = 0; i < n; i++) dst[i] = (_Float16)(x[i] * mul);
    }
#endif
}

/* e^x, ~1 ulp for x in [-87, 88] (Cephes expf): x = n ln2 + r, |r| <= ln2 / 2,
 * e^x = 2^n e^r with a degree-7 polynomial for e^r. Below -87 it returns e^-87
 * (~1.6e-38), never a denormal; NaN stays NaN. Branch-free, so loops over it vectorise. */
static ALWAYS_INLINE float fast_exp(float x) {
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f + round;
    float n = t - round;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t tb, round_bits, bits;
    memcpy(&tb, &t, sizeof tb);
    memcpy(&round_bits, &round, sizeof round_bits);
    bits = (tb - round_bits + 127u) << 23; /* 2^n: the exponent field n + 127 */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif
