/* A decode step's linear layers: y = x W^T (+ b) for up to 32 rows, W streamed once, in
 * fp32 on any build and in bf16 where the build has AVX512-BF16.
 *
 * With a few rows a linear layer is a stream of its weights, as in cpu_linear.c for bf16
 * on AMX tiles. Here the products are the CPU's vector instructions. The weights are
 * packed once into panels of V columns (one vector of fp32 outputs), each panel's K
 * values per column one step after another, the order the kernel reads them:
 *
 *   fp32 (kvlab_stream_pack)       packed[(p K + kk) V + c]          = W[p V + c][kk]
 *   bf16 (kvlab_stream_pack_bf16)  packed[((p K/2 + kp) V + c) 2 + j] = W[p V + c][2 kp + j]
 *
 * (in bf16 each column's pair of K values side by side in 32 bits, as vdpbf16ps takes
 * them). A task is a run of consecutive panels; for each P of them side by side, blocks of
 * up to BLOCK_ROWS rows (bf16: BF16_BLOCK_ROWS) keep P vectors of V fp32 outputs per row in
 * registers and walk the panels' steps: fp32 adds x[r][kk] times each panel's vector of the
 * step (one broadcast, P FMAs per row), bf16 adds x[r]'s pair kp times each panel's pairs (one
 * vdpbf16ps per row and panel: both products, summed in fp32). P is as many panels (up to
 * 4) as fit the registers beside the block's accumulators: each x value then serves P
 * vectors, and a row's P chains do not wait on one another. Each step's vectors are
 * loaded once for the block, the lines PREFETCH vectors further on in each panel
 * prefetched. A panel is read from memory once: its later row blocks find it in the
 * cache. Then the bias is added in fp32 (bf16: and each output rounded to bf16, nearest
 * even).
 *
 * Every output is one fp32 chain of fused multiply-adds (fma_f) over the steps in order,
 * fixed by its row and column alone, so the result is the same bits for any thread count
 * and any rows beside it. N a multiple of V (bf16: of 16, K even). On the 2-core Xeon
 * kvlab is developed on, SmolLM2-135M's 121 fp32 matmuls for 16 rows take about 0.7 of
 * oneDNN's time (1 row: the weights at about 26 GB/s); on the 2-core AMD EPYC with AVX-512
 * and AVX512-BF16 (no AMX) its bf16 ones took about 0.7 of oneDNN's, and on the 2-core
 * AMD EPYC with AVX2 its fp32 ones about two thirds, one panel at a time (`kvlab profile`
 * times both).
 */

#include "cpu_common.h"

#if defined(__AVX512BF16__) && V == 16 /* vdpbf16ps: bf16 pairs multiplied, summed in fp32 */
#include <immintrin.h>
#define BF16_BUILT 1
#else
#define BF16_BUILT 0
#endif

#define STREAM_MAX_ROWS 32
#define TASKS_PER_THREAD 2 /* runs of panels a thread takes, for balance (each run a
                              * stream of its own to start: 4 were slower) */
#define MAX_PANELS 4       /* panels a block walks side by side */
#define PREFETCH 128       /* vectors ahead in the panel's stream */
#define KVLAB_ENOBF16 5    /* this build has no AVX512-BF16 */
#if V == 16
#define REGISTERS 32  /* vector registers */
#define BLOCK_ROWS 14 /* fp32 rows per block at most: 14 x 2 accumulators, 2 panels, a
                       * broadcast (16 rows as two blocks of 8 over 3 panels run faster than
                       * one block of 16 over 1) */
#define BF16_BLOCK_ROWS 16 /* bf16 rows per block at most: twice fp32's products per byte, one
                            * block of 16 over 1 panel runs faster than two of 8 */
#else
#define REGISTERS 16
#define BLOCK_ROWS 12 /* 12 accumulators, a panel and a broadcast */
#define BF16_BLOCK_ROWS 12 /* (no bf16 kernel without AVX-512) */
#endif

/* Columns per panel of the kernel for `dtype`: V in fp32 where the build has FMA
 * instructions; 16 in bf16 where it has AVX512-BF16; 0 where there is no such kernel. */
int kvlab_stream_width(int dtype) {
    return dtype == DT_F32 && KVLAB_HAVE_FMA ? V : dtype == DT_BF16 && BF16_BUILT ? 16 : 0;
}

/* W (N, K) fp32, row stride w_stride elements -> packed (N * K elements, the layout above). */
int kvlab_stream_pack(const float *w, int64_t w_stride, int64_t n, int64_t k, float *packed) {
    if (!w || !packed || n < V || k < 1 || n % V || w_stride < k) return KVLAB_EARG;
    for (int64_t p = 0; p < n / V; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < V; c++)
                packed[(p * k + kk) * V + c] = w[(p * V + c) * w_stride + kk];
    return KVLAB_OK;
}

/* W (N, K) bf16, row stride w_stride elements -> packed (N * K elements, the layout above,
 * panels of 16 columns). */
int kvlab_stream_pack_bf16(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                           uint16_t *packed) {
    if (!w || !packed || n < 16 || k < 2 || n % 16 || k % 2 || w_stride < k) return KVLAB_EARG;
    for (int64_t p = 0; p < n / 16; p++)
        for (int64_t kp = 0; kp < k / 2; kp++)
            for (int c = 0; c < 16; c++)
                for (int j = 0; j < 2; j++)
                    packed[((p * (k / 2) + kp) * 16 + c) * 2 + j] =
                        w[(p * 16 + c) * w_stride + 2 * kp + j];
    return KVLAB_OK;
}

typedef struct {
    const void *x, *w, *bias; /* fp32, or bf16 where bf16 is 1 */
    void *out;
    int64_t x_stride, out_stride, n, k;
    int bf16, rows, tasks, next_task;
} Stream;

/* fp32: out[r0 + r][(p + q) V ..] = x[r0 + r] . panel p + q (+ bias) for r < R, q < P:
 * P panels side by side, so each x value broadcast serves P vectors and each output row
 * has P independent chains (one row's single chain waits on the FMA's latency) */
static ALWAYS_INLINE void block(const Stream *s, int64_t p, int r0, int R, int P) {
    const float *w = (const float *)s->w + p * s->k * V;
    const float *x = (const float *)s->x + r0 * s->x_stride;
    const int64_t next = s->k * V; /* from one panel to the next */
    vf acc[MAX_PANELS][BLOCK_ROWS];
    for (int q = 0; q < P; q++)
        for (int r = 0; r < R; r++) acc[q][r] = (vf){0};
    for (int64_t kk = 0; kk < s->k; kk++) {
        vf wv[MAX_PANELS];
        for (int q = 0; q < P; q++) {
            __builtin_prefetch(w + q * next + (kk + PREFETCH) * V);
            wv[q] = load_f(w + q * next + kk * V);
        }
        for (int r = 0; r < R; r++) {
            const vf xr = splat_f(x[r * s->x_stride + kk]);
            for (int q = 0; q < P; q++) acc[q][r] = fma_f(acc[q][r], xr, wv[q]);
        }
    }
    for (int q = 0; q < P; q++) {
        const vf b = s->bias ? load_f((const float *)s->bias + (p + q) * V) : (vf){0};
        float *out = (float *)s->out + r0 * s->out_stride + (p + q) * V;
        for (int r = 0; r < R; r++) store_f(out + r * s->out_stride, acc[q][r] + b);
    }
}

#if BF16_BUILT
/* bf16: the same, each step a pair of K values (vdpbf16ps), rounded to bf16 at the end */
static ALWAYS_INLINE void block_bf16(const Stream *s, int64_t p, int r0, int R, int P) {
    const uint16_t *w = (const uint16_t *)s->w + p * s->k * 16;
    const uint16_t *x = (const uint16_t *)s->x + r0 * s->x_stride;
    const int64_t next = s->k * 16;
    __m512 acc[MAX_PANELS][BF16_BLOCK_ROWS];
    for (int q = 0; q < P; q++)
        for (int r = 0; r < R; r++) acc[q][r] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < s->k / 2; kp++) {
        __m512bh wv[MAX_PANELS];
        for (int q = 0; q < P; q++) {
            __builtin_prefetch(w + q * next + (kp + PREFETCH) * 32);
            wv[q] = (__m512bh)_mm512_loadu_si512(w + q * next + kp * 32);
        }
        for (int r = 0; r < R; r++) {
            int32_t pair; /* x[r][2 kp], x[r][2 kp + 1] */
            memcpy(&pair, x + r * s->x_stride + 2 * kp, sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < P; q++) acc[q][r] = _mm512_dpbf16_ps(acc[q][r], xr, wv[q]);
        }
    }
    for (int q = 0; q < P; q++) {
        const __m512 b =
            s->bias ? (__m512)load_v(s->bias, DT_BF16, (p + q) * 16) : _mm512_setzero_ps();
        uint16_t *out = (uint16_t *)s->out + r0 * s->out_stride + (p + q) * 16;
        for (int r = 0; r < R; r++)
            _mm256_storeu_si256((void *)(out + r * s->out_stride),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[q][r], b)));
    }
}
#define BLOCK(s, p, r0, R, P) ((s)->bf16 ? block_bf16(s, p, r0, R, P) : block(s, p, r0, R, P))
#else
#define BLOCK(s, p, r0, R, P) block(s, p, r0, R, P)
#endif

/* Panels at once for blocks of up to R rows: the most (up to MAX_PANELS) whose R x P
 * accumulators, P panel vectors and a broadcast fit the registers. */
static int panels_for(int R) {
    int P = MAX_PANELS;
    while (P > 1 && R * P + P + 1 > REGISTERS) P--;
    return P;
}

/* a constant R and P keep the accumulators in registers */
#define ROW_CASES(P)                                                                         \
    switch (R) {                                                                             \
    ROWS_ABOVE_12(P)                                                                         \
    case 12: BLOCK(s, p, r0, 12, P); break;                                                  \
    case 11: BLOCK(s, p, r0, 11, P); break;                                                  \
    case 10: BLOCK(s, p, r0, 10, P); break;                                                  \
    case 9: BLOCK(s, p, r0, 9, P); break;                                                    \
    case 8: BLOCK(s, p, r0, 8, P); break;                                                    \
    case 7: BLOCK(s, p, r0, 7, P); break;                                                    \
    case 6: BLOCK(s, p, r0, 6, P); break;                                                    \
    case 5: BLOCK(s, p, r0, 5, P); break;                                                    \
    case 4: BLOCK(s, p, r0, 4, P); break;                                                    \
    case 3: BLOCK(s, p, r0, 3, P); break;                                                    \
    case 2: BLOCK(s, p, r0, 2, P); break;                                                    \
    default: BLOCK(s, p, r0, 1, P); break;                                                   \
    }
#if BF16_BUILT /* bf16's blocks of up to 16 rows, fp32's of up to 14 */
#define ROWS_ABOVE_12(P)                                                                     \
    case 16: block_bf16(s, p, r0, 16, P); break;                                             \
    case 15: block_bf16(s, p, r0, 15, P); break;                                             \
    case 14: BLOCK(s, p, r0, 14, P); break;                                                  \
    case 13: BLOCK(s, p, r0, 13, P); break;
#elif BLOCK_ROWS == 14
#define ROWS_ABOVE_12(P)                                                                     \
    case 14: BLOCK(s, p, r0, 14, P); break;                                                  \
    case 13: BLOCK(s, p, r0, 13, P); break;
#else
#define ROWS_ABOVE_12(P)
#endif

/* Rows in blocks of equal size (within one), at most BLOCK_ROWS each (bf16:
 * BF16_BLOCK_ROWS), and each block over P panels at once (panels_for). Equal blocks keep
 * every block's chains many: 16 rows on AVX2 are two blocks of 8, not 12 and 4, whose four
 * accumulator chains leave the FMA units waiting on their latency (on the 2-core AMD EPYC
 * with AVX2, SmolLM2's gate/up for 16 rows from the cache: 86 GFLOP/s as 12 + 4, 101 as
 * 8 + 8). On the 2-core Xeon,
 * SmolLM2-135M's 121 fp32 matmuls of a step, from memory, against one panel at a time (and
 * 4 runs a thread): 1 row 25 -> 21 ms, 10 rows 31 -> 26, 16 rows (two blocks of 8 over 3
 * panels) 34.5 -> 30.5, 32 rows 54 -> 46. */
static void panels(const Stream *s, int64_t p0, int64_t p1) {
    const int most = s->bf16 ? BF16_BLOCK_ROWS : BLOCK_ROWS;
    const int blocks = (s->rows + most - 1) / most;
    const int P = panels_for((s->rows + blocks - 1) / blocks);
    for (int64_t p = p0; p < p1; p += P) {
        const int here = p1 - p < P ? (int)(p1 - p) : P; /* the task's last panels */
        for (int b = 0, r0 = 0; b < blocks; b++) {
            const int R = (s->rows - r0) / (blocks - b); /* the rest shared equally */
            switch (here) {
            case 4: ROW_CASES(4); break;
            case 3: ROW_CASES(3); break;
            case 2: ROW_CASES(2); break;
            default: ROW_CASES(1); break;
            }
            r0 += R;
        }
    }
}

static int stream_tasks(void *arg) {
    Stream *s = arg;
    const int64_t count = s->n / V;
    for (;;) {
        const int task = __atomic_fetch_add(&s->next_task, 1, __ATOMIC_RELAXED);
        if (task >= s->tasks) return KVLAB_OK;
        panels(s, count * task / s->tasks, count * (task + 1) / s->tasks);
    }
}

/* Panels are V columns wide in either dtype: bf16 runs only where BF16_BUILT, so V is 16. */
static int run(Stream s, int num_threads) {
    const int64_t count = s.n / V;
    if (!s.x || !s.w || !s.out || s.rows < 1 || s.rows > STREAM_MAX_ROWS || s.n < V ||
        s.n % V || s.k < 1 || (s.bf16 && s.k % 2) || s.x_stride < s.k || s.out_stride < s.n)
        return KVLAB_EARG;
    const int threads = num_threads < 1 ? 1 : num_threads;
    s.tasks = (int)(count < threads * TASKS_PER_THREAD ? count : threads * TASKS_PER_THREAD);
    return kvlab_run_parallel(threads < s.tasks ? threads : s.tasks, stream_tasks, &s);
}

/* x (rows, K) fp32, row stride x_stride; packed: kvlab_stream_pack's W (N, K); bias (N,)
 * fp32 or NULL; out (rows, N) fp32, row stride out_stride. Returns 0 or KVLAB_EARG. */
int kvlab_stream_linear(const float *x, int64_t x_stride, int rows, const float *packed,
                        const float *bias, float *out, int64_t out_stride, int64_t n, int64_t k,
                        int num_threads) {
    return run((Stream){.x = x, .w = packed, .bias = bias, .out = out, .x_stride = x_stride,
                        .out_stride = out_stride, .n = n, .k = k, .rows = rows},
               num_threads);
}

/* The same in bf16: x, bias and out bf16, packed by kvlab_stream_pack_bf16. Returns 0,
 * KVLAB_EARG, or KVLAB_ENOBF16 where the build has no AVX512-BF16. */
int kvlab_stream_linear_bf16(const uint16_t *x, int64_t x_stride, int rows,
                             const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                             int64_t out_stride, int64_t n, int64_t k, int num_threads) {
    if (!BF16_BUILT) return KVLAB_ENOBF16;
    return run((Stream){.x = x, .w = packed, .bias = bias, .out = out, .x_stride = x_stride,
                        .out_stride = out_stride, .n = n, .k = k, .bf16 = 1, .rows = rows},
               num_threads);
}
