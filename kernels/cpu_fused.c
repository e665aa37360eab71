/* The elementwise parts of a decoder layer in bf16 or fp32, each one pass over its rows:
 * where torch runs five to seven ops (and as many passes over memory, each a Python call),
 * the runner makes one call (kernels/cpu_fused.py).
 *
 *   add + RMS norm  h += delta (when given); out = weight * round(h * rsqrt(mean(h^2) + eps))
 *   SwiGLU          out = round(silu(gate)) * up
 *   RoPE            (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for each head's halves
 *
 * In bf16 each step is rounded to bf16 (nearest even) where torch's bf16 ops round: the
 * residual add, the normalised row, each RoPE product and sum, silu(gate), the products.
 * Products and sums of two bf16 values are exact in fp32, so the add and RoPE give torch's
 * bits; the norm's sum of squares (V lanes, then their sum) may differ from torch's by one
 * bf16 step in a few elements, and silu(gate) (the kernels' e^x polynomial, and with
 * AVX-512 a reciprocal estimate refined once instead of a division) by one, two after the
 * product. In fp32 nothing is rounded between the steps: the results are torch's to a few
 * ulp (the sum of squares' order, e^x, the reciprocal, FMAs where torch rounds twice).
 *
 * Rows are split in tasks of ROWS_PER_TASK over the library's threads (cpu_pool.c) when a
 * call has MIN_PARALLEL elements or more; each row's result depends on that row alone.
 * Row lengths must be multiples of V (RoPE: half a head). Returns 0, or a KVLAB_E* code.
 */

#include <math.h>

#include "cpu_tiles.h"

#define ROWS_PER_TASK 16
#define FUSED_MIN_PARALLEL (1 << 15) /* elements */

enum { OP_ADD_NORM = 0, OP_SILU_MUL = 1, OP_ROPE = 2 };

typedef struct {
    int op, cols, head_dim, dtype; /* dtype: DT_BF16 or DT_F32, of every tensor */
    int64_t rows;
    void *x;              /* add + norm: h (updated); RoPE: x; SwiGLU: gate */
    const void *y;        /* add + norm: delta or NULL; SwiGLU: up; RoPE: cos */
    const void *z;        /* add + norm: weight; RoPE: sin */
    void *out;
    int64_t x_stride, y_stride, out_stride; /* row strides, elements (RoPE: sin's = cos's) */
    float eps;
    int tasks, next_task;
} Rows;

#if defined(__AVX512F__) && V == 16
#include <immintrin.h>
#endif

/* Element i of an array of dt (DT_BF16 or DT_F32): its address, V of them as fp32, V of
 * them stored (rounded to bf16 where dt is), and x rounded as dt's ops round it. */
static ALWAYS_INLINE void *at(const void *base, int dt, int64_t i) {
    return (char *)base + i * (dt == DT_F32 ? 4 : 2);
}

static ALWAYS_INLINE vf get(const void *base, int dt, int64_t i) { return load_v(base, dt, i); }

static ALWAYS_INLINE void put(void *base, int dt, int64_t i, vf x) {
    if (dt == DT_F32) {
        store_f((float *)base + i, x);
        return;
    }
    uint16_t *p = (uint16_t *)base + i;
#if defined(__AVX512BF16__) && V == 16
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)x));
#else
    *(vu16_mem *)p = __builtin_convertvector(bf16_bits(x) >> 16, vu16);
#endif
}

static ALWAYS_INLINE vf rnd(vf x, int dt) { return dt == DT_F32 ? x : round_bf16(x); }

/* 1 / x to within 2 ulp: a reciprocal estimate and one Newton step where AVX-512 has one
 * (a division takes ten times as long), else a division */
static ALWAYS_INLINE vf reciprocal(vf x) {
#if defined(__AVX512F__) && V == 16
    const vf r = (vf)_mm512_rcp14_ps((__m512)x);
    return r * (2.0f - x * r);
#else
    return 1.0f / x;
#endif
}

static ALWAYS_INLINE void add_norm_row(const Rows *a, int64_t r, int dt) {
    void *h = at(a->x, dt, r * a->x_stride), *out = at(a->out, dt, r * a->out_stride);
    const void *delta = a->y ? at(a->y, dt, r * a->y_stride) : NULL;
    vf squares = {0};
    for (int c = 0; c < a->cols; c += V) {
        vf x = get(h, dt, c);
        if (delta) {
            x = rnd(x + get(delta, dt, c), dt);
            put(h, dt, c, x);
        }
        squares += x * x;
    }
    float sum = 0.0f;
    for (int i = 0; i < V; i++) sum += squares[i];
    const float inv = 1.0f / sqrtf(sum / (float)a->cols + a->eps);
    for (int c = 0; c < a->cols; c += V)
        put(out, dt, c, get(a->z, dt, c) * rnd(get(h, dt, c) * inv, dt));
}

static ALWAYS_INLINE void silu_mul_row(const Rows *a, int64_t r, int dt) {
    const void *gate = at(a->x, dt, r * a->x_stride), *up = at(a->y, dt, r * a->y_stride);
    void *out = at(a->out, dt, r * a->out_stride);
    for (int c = 0; c < a->cols; c += V) {
        const vf g = get(gate, dt, c);
        const vf silu = rnd(g * reciprocal(1.0f + fast_exp_v(-g)), dt);
        put(out, dt, c, silu * get(up, dt, c));
    }
}

static ALWAYS_INLINE void rope_row(const Rows *a, int64_t r, int dt) {
    const void *x = at(a->x, dt, r * a->x_stride);
    void *out = at(a->out, dt, r * a->out_stride);
    const void *cos = at(a->y, dt, r * a->y_stride), *sin = at(a->z, dt, r * a->y_stride);
    const int half = a->head_dim / 2;
    for (int head = 0; head < a->cols; head += a->head_dim)
        for (int c = 0; c < half; c += V) {
            const vf x1 = get(x, dt, head + c), x2 = get(x, dt, head + half + c);
            const vf cos1 = get(cos, dt, c), cos2 = get(cos, dt, half + c);
            const vf sin1 = get(sin, dt, c), sin2 = get(sin, dt, half + c);
            put(out, dt, head + c, rnd(x1 * cos1, dt) - rnd(x2 * sin1, dt));
            put(out, dt, head + half + c, rnd(x2 * cos2, dt) + rnd(x1 * sin2, dt));
        }
}

static ALWAYS_INLINE void row(const Rows *a, int64_t r, int dt) {
    if (a->op == OP_ADD_NORM) add_norm_row(a, r, dt);
    else if (a->op == OP_SILU_MUL) silu_mul_row(a, r, dt);
    else rope_row(a, r, dt);
}

static int take_rows(void *arg) {
    Rows *a = arg;
    for (;;) {
        const int task = __atomic_fetch_add(&a->next_task, 1, __ATOMIC_RELAXED);
        if (task >= a->tasks) return KVLAB_OK;
        const int64_t first = (int64_t)task * ROWS_PER_TASK;
        const int64_t last = first + ROWS_PER_TASK < a->rows ? first + ROWS_PER_TASK : a->rows;
        for (int64_t r = first; r < last; r++) { /* a constant dtype per loop */
            if (a->dtype == DT_F32) row(a, r, DT_F32);
            else row(a, r, DT_BF16);
        }
    }
}

static int run_rows(Rows *a, int num_threads) {
    if (a->rows < 0 || a->cols < V || a->cols % V || !a->x || !a->out) return KVLAB_EARG;
    if (a->dtype != DT_BF16 && a->dtype != DT_F32) return KVLAB_EARG;
    if (a->rows == 0) return KVLAB_OK;
    const int64_t tasks = (a->rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    if (tasks > INT32_MAX) return KVLAB_EARG;
    a->tasks = (int)tasks;
    a->next_task = 0;
    int threads = a->rows * a->cols < FUSED_MIN_PARALLEL || num_threads < 1 ? 1 : num_threads;
    threads = threads < a->tasks ? threads : a->tasks;
    return threads == 1 ? take_rows(a) : kvlab_run_parallel(threads, take_rows, a);
}

/* h, delta, out: (rows, hidden) with row strides; weight (hidden,); delta may be NULL.
 * Every tensor of the entry points here is of `dtype` (DT_BF16 or DT_F32). */
int kvlab_add_rms_norm(void *h, int64_t h_stride, const void *delta, int64_t delta_stride,
                       const void *weight, void *out, int64_t out_stride, int64_t rows,
                       int hidden, float eps, int num_threads, int dtype) {
    Rows a = {.op = OP_ADD_NORM, .dtype = dtype, .cols = hidden, .rows = rows, .x = h,
              .y = delta, .z = weight, .out = out, .x_stride = h_stride, .y_stride = delta_stride,
              .out_stride = out_stride, .eps = eps};
    return weight ? run_rows(&a, num_threads) : KVLAB_EARG;
}

/* gate, up, out: (rows, inter) with row strides. */
int kvlab_silu_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride,
                   void *out, int64_t out_stride, int64_t rows, int inter, int num_threads,
                   int dtype) {
    Rows a = {.op = OP_SILU_MUL, .dtype = dtype, .cols = inter, .rows = rows,
              .x = (void *)gate, .y = up, .out = out, .x_stride = gate_stride,
              .y_stride = up_stride, .out_stride = out_stride};
    return up ? run_rows(&a, num_threads) : KVLAB_EARG;
}

/* x, out: (rows, heads * head_dim) with row strides (out may be x); cos, sin:
 * (rows, head_dim) with row stride cs_stride. */
int kvlab_rope(const void *x, int64_t x_stride, const void *cos, const void *sin,
               int64_t cs_stride, void *out, int64_t out_stride, int64_t rows, int heads,
               int head_dim, int num_threads, int dtype) {
    Rows a = {.op = OP_ROPE, .dtype = dtype, .cols = heads * head_dim, .head_dim = head_dim,
              .rows = rows, .x = (void *)x, .y = cos, .z = sin, .out = out, .x_stride = x_stride,
              .y_stride = cs_stride, .out_stride = out_stride};
    if (!cos || !sin || heads < 1 || head_dim < 2 * V || head_dim % (2 * V)) return KVLAB_EARG;
    return run_rows(&a, num_threads);
}
