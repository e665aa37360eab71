/* Batch-invariant products and e^x on the CPU: each output's bits fixed by its own inputs.
 *
 * kvlab_invariant_bmm: out[b][m][n] = sum_k x[b][m][k] * w[b][n][k], in fp32. Every output
 * is one dot product summed in one order, fixed by k alone: LANES partial sums, lane j
 * taking the terms k = j, j + LANES, j + 2 LANES, ... in increasing k, then the lanes
 * added in a fixed pairwise tree. Nothing in that order depends on M (how many rows came
 * with row m), on N, on the thread count or on how the work is split: a task is a block
 * of NB output columns of one batch entry, and every output is summed by one task.
 * Terms past a row's own end that are exact zeros (a masked attention weight, a padded
 * key) add nothing to their lane, so a row's sum is the same inside a longer product.
 *
 * kvlab_invariant_exp: out[i] = e^x[i] with the polynomial fast_exp of cpu_common.h for
 * every element; torch's vectorised loops compute a tail of scalar elements with another
 * function, so there an element's bits depend on where it sits in the tensor.
 *
 * e^-inf is 0 (a masked score).
 *
 * The order is written in C, and this file is compiled with floating-point contraction
 * off: every product and sum rounds on its own, never fused into an FMA, so no compiler
 * choice between the vector body and a tail changes a bit. The tails go through the same
 * vector code as the body (zero-padded), so every element takes one path. Dtypes: x and w
 * float32 or bfloat16 (cpu_common.h's codes), out float32. Returns 0, or a KVLAB_E* code.
 */

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "cpu_common.h"

#define LANES 16 /* partial sums per output, on every CPU */
#define NB 16    /* output columns per task */
#if defined(__AVX512F__)
#define TM 4 /* register tile: rows ... (16-float vectors: 32 registers) */
#define TN 4 /* ... by columns */
#else
#define TM 2 /* register tile: rows ... (AVX2: two registers a lane set, 16 in all) */
#define TN 2
#endif
#define TN1 (2 * TN) /* columns of a one-row tile: a decode step's single row */
#define MIN_PARALLEL (1 << 15) /* below this many multiply-adds, one thread */

typedef float lanes __attribute__((vector_size(LANES * 4)));
typedef uint16_t lanes16 __attribute__((vector_size(LANES * 2)));
typedef uint32_t lanes32 __attribute__((vector_size(LANES * 4)));

typedef struct {
    const void *x, *w;
    float *out;
    int dtype_x, dtype_w;
    int64_t batch, M, N, K;
    int64_t x_batch, x_row, w_batch, w_row; /* element strides; the last dim is contiguous */
    int64_t tasks, col_blocks;
    int64_t next_task;
} Bmm;

static ALWAYS_INLINE lanes load_lanes(const void *base, int dtype, int64_t i) {
    lanes x;
    if (dtype == DT_BF16) {
        lanes16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        lanes32 u = __builtin_convertvector(h, lanes32) << 16;
        memcpy(&x, &u, sizeof x);
    } else {
        memcpy(&x, (const float *)base + i, sizeof x);
    }
    return x;
}

/* The fixed tree: ((l0 + l1) + (l2 + l3)) + ... over 16 lanes. */
static ALWAYS_INLINE float add_lanes(lanes a) {
    float s[LANES];
    memcpy(s, &a, sizeof s);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) s[i] = s[2 * i] + s[2 * i + 1];
    return s[0];
}

/* x[at .. at + n) as lanes, zero past n (n < LANES): a tail takes the body's path. */
static ALWAYS_INLINE lanes load_tail(const void *base, int dtype, int64_t at, int64_t n) {
    float part[LANES] = {0};
    for (int64_t i = 0; i < n; i++) part[i] = load(base, dtype, at + i);
    lanes x;
    memcpy(&x, part, sizeof x);
    return x;
}

/* Rows m0 .. m0 + tm - 1 by columns n0 .. n0 + tn - 1 (a row or column past the end
 * repeats the last one and is not stored): each output's lanes over the whole of K. The
 * tile's shape changes which outputs share a pass over K, never an output's order. */
static ALWAYS_INLINE void tile(const Bmm *p, int64_t b, int64_t m0, int64_t n0, int dx, int dw,
                               const int tm, const int tn) {
    const int64_t K = p->K, whole = K / LANES * LANES;
    int64_t xa[TM], wa[TN1];
    for (int i = 0; i < tm; i++)
        xa[i] = b * p->x_batch + (m0 + i < p->M ? m0 + i : p->M - 1) * p->x_row;
    for (int j = 0; j < tn; j++)
        wa[j] = b * p->w_batch + (n0 + j < p->N ? n0 + j : p->N - 1) * p->w_row;
    lanes acc[TM][TN1];
    memset(acc, 0, sizeof acc);
    lanes xv[TM], wv[TN1];
    for (int64_t k = 0; k < whole; k += LANES) {
        for (int i = 0; i < tm; i++) xv[i] = load_lanes(p->x, dx, xa[i] + k);
        for (int j = 0; j < tn; j++) wv[j] = load_lanes(p->w, dw, wa[j] + k);
        for (int i = 0; i < tm; i++)
            for (int j = 0; j < tn; j++) acc[i][j] += xv[i] * wv[j];
    }
    if (whole < K) {
        for (int i = 0; i < tm; i++) xv[i] = load_tail(p->x, dx, xa[i] + whole, K - whole);
        for (int j = 0; j < tn; j++) wv[j] = load_tail(p->w, dw, wa[j] + whole, K - whole);
        for (int i = 0; i < tm; i++)
            for (int j = 0; j < tn; j++) acc[i][j] += xv[i] * wv[j];
    }
    for (int i = 0; i < tm; i++)
        for (int j = 0; j < tn; j++)
            if (m0 + i < p->M && n0 + j < p->N)
                p->out[(b * p->M + m0 + i) * p->N + n0 + j] = add_lanes(acc[i][j]);
}

/* One task's columns: rows TM at a time, then the rows left over (all of them for a
 * decode step's single row) one at a time against TN1 columns, so no repeated row is
 * computed for nothing. */
static ALWAYS_INLINE void task_body(const Bmm *p, int64_t task, int dx, int dw) {
    const int64_t b = task / p->col_blocks, c0 = task % p->col_blocks * NB;
    const int64_t c1 = c0 + NB < p->N ? c0 + NB : p->N, tiled = p->M / TM * TM;
    for (int64_t n0 = c0; n0 < c1; n0 += TN)
        for (int64_t m0 = 0; m0 < tiled; m0 += TM) tile(p, b, m0, n0, dx, dw, TM, TN);
    for (int64_t n0 = c0; n0 < c1; n0 += TN1)
        for (int64_t m0 = tiled; m0 < p->M; m0++) tile(p, b, m0, n0, dx, dw, 1, TN1);
}

static int take_tasks(void *arg) {
    Bmm *p = arg;
    for (;;) {
        const int64_t t = __atomic_fetch_add(&p->next_task, 1, __ATOMIC_RELAXED);
        if (t >= p->tasks) break;
        if (p->dtype_x == DT_F32 && p->dtype_w == DT_F32) task_body(p, t, DT_F32, DT_F32);
        else if (p->dtype_x == DT_F32) task_body(p, t, DT_F32, DT_BF16);
        else if (p->dtype_w == DT_F32) task_body(p, t, DT_BF16, DT_F32);
        else task_body(p, t, DT_BF16, DT_BF16);
    }
    return KVLAB_OK;
}

int kvlab_invariant_bmm(const void *x, const void *w, float *out, int dtype_x, int dtype_w,
                        int64_t batch, int64_t M, int64_t N, int64_t K, int64_t x_batch,
                        int64_t x_row, int64_t w_batch, int64_t w_row, int num_threads) {
    if (!x || !w || !out || batch < 1 || M < 1 || N < 1 || K < 1) return KVLAB_EARG;
    if ((dtype_x != DT_F32 && dtype_x != DT_BF16) || (dtype_w != DT_F32 && dtype_w != DT_BF16))
        return KVLAB_EARG;
    if (x_batch < 0 || x_row < K || w_batch < 0 || w_row < K) return KVLAB_EARG;
    Bmm p = {.x = x, .w = w, .out = out, .dtype_x = dtype_x, .dtype_w = dtype_w,
             .batch = batch, .M = M, .N = N, .K = K, .x_batch = x_batch, .x_row = x_row,
             .w_batch = w_batch, .w_row = w_row};
    p.col_blocks = (N + NB - 1) / NB;
    p.tasks = batch * p.col_blocks;
    const int threads = batch * M * N * K < MIN_PARALLEL ? 1
                        : num_threads < p.tasks            ? num_threads
                                                           : (int)p.tasks;
    return kvlab_run_parallel(threads < 1 ? 1 : threads, take_tasks, &p);
}

/* e^x of LANES elements, one element at a time in the same code: zero for -inf. */
static ALWAYS_INLINE void exp_block(const float *x, float *out) {
    for (int i = 0; i < LANES; i++) out[i] = x[i] == -__builtin_inff() ? 0.0f : fast_exp(x[i]);
}

int kvlab_invariant_exp(const float *x, float *out, int64_t n) {
    if (!x || !out || n < 0) return KVLAB_EARG;
    const int64_t whole = n / LANES * LANES;
    for (int64_t i = 0; i < whole; i += LANES) exp_block(x + i, out + i);
    if (whole < n) { /* the tail through the same block, padded */
        float in[LANES] = {0}, got[LANES];
        memcpy(in, x + whole, sizeof(float) * (size_t)(n - whole));
        exp_block(in, got);
        memcpy(out + whole, got, sizeof(float) * (size_t)(n - whole));
    }
    return KVLAB_OK;
}
