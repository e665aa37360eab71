/* A decode step's fp32 linear layers: y = x W^T (+ b) for up to 32 rows, W streamed once.
 *
 * With a few rows a linear layer is a stream of its weights, as in cpu_linear.c for bf16
 * on AMX tiles. Here the weights are fp32 and the products FMAs on the CPU's vectors. The
 * weights are packed once (kvlab_stream_pack) into panels of V columns (one vector), each
 * panel K vectors one after another, the order the kernel reads them:
 *
 *   packed[(p K + kk) V + c] = W[p V + c][kk]
 *
 * A task is a run of consecutive panels; for each, blocks of up to ROWS rows keep one
 * vector of V outputs per row in registers, and for kk = 0 .. K - 1 add x[r][kk] times
 * the panel's vector kk (one FMA per row; the vector is loaded once for the block, the
 * line PREFETCH vectors further on in the stream prefetched). A panel is read from memory
 * once: its later row blocks find it in the cache. Then the bias is added.
 *
 * Every output is one fp32 chain of FMAs over kk in order, fixed by its row and column
 * alone, so the result is the same bits for any thread count and any rows beside it. N a
 * multiple of V. On the 2-core Xeon kvlab is developed on, SmolLM2-135M's 121 matmuls for
 * 16 rows take about three quarters of oneDNN's time (`kvlab profile --dtype float32`
 * times both).
 */

#include "cpu_common.h"

#define STREAM_MAX_ROWS 32
#define TASKS_PER_THREAD 4 /* runs of panels a thread takes, for balance */
#define PREFETCH 128       /* vectors ahead in the panel's stream */
#if V == 16
#define ROWS 16 /* rows per block: ROWS accumulators, the panel's vector and a broadcast */
#else
#define ROWS 12 /* of AVX2's 16 registers */
#endif

/* The vector width the kernel packs for: its panels are this many columns wide. */
int kvlab_stream_width(void) { return V; }

/* W (N, K) fp32, row stride w_stride elements -> packed (N * K elements, the layout above). */
int kvlab_stream_pack(const float *w, int64_t w_stride, int64_t n, int64_t k, float *packed) {
    if (!w || !packed || n < V || k < 1 || n % V || w_stride < k) return KVLAB_EARG;
    for (int64_t p = 0; p < n / V; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < V; c++)
                packed[(p * k + kk) * V + c] = w[(p * V + c) * w_stride + kk];
    return KVLAB_OK;
}

typedef struct {
    const float *x, *w, *bias;
    float *out;
    int64_t x_stride, out_stride, n, k;
    int rows, tasks, next_task;
} Stream;

/* out[r0 + r][p V ..] = x[r0 + r] . panel p (+ bias) for r < R */
static ALWAYS_INLINE void block(const Stream *s, int64_t p, int r0, int R) {
    const float *w = s->w + p * s->k * V, *x = s->x + r0 * s->x_stride;
    vf acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    for (int64_t kk = 0; kk < s->k; kk++) {
        __builtin_prefetch(w + (kk + PREFETCH) * V);
        const vf wv = load_f(w + kk * V);
        for (int r = 0; r < R; r++) acc[r] += x[r * s->x_stride + kk] * wv;
    }
    const vf b = s->bias ? load_f(s->bias + p * V) : (vf){0};
    for (int r = 0; r < R; r++) store_f(s->out + (r0 + r) * s->out_stride + p * V, acc[r] + b);
}

static void panels(const Stream *s, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
        for (int r0 = 0; r0 < s->rows;) { /* blocks of ROWS, 8, 4, 2, 1 rows */
            const int left = s->rows - r0;
            const int R = left >= ROWS ? ROWS : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            switch (R) { /* a constant R keeps the accumulators in registers */
            case ROWS: block(s, p, r0, ROWS); break;
            case 8: block(s, p, r0, 8); break;
            case 4: block(s, p, r0, 4); break;
            case 2: block(s, p, r0, 2); break;
            default: block(s, p, r0, 1); break;
            }
            r0 += R;
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

/* x (rows, K) fp32, row stride x_stride; packed: kvlab_stream_pack's W (N, K); bias (N,)
 * fp32 or NULL; out (rows, N) fp32, row stride out_stride. Returns 0 or KVLAB_EARG. */
int kvlab_stream_linear(const float *x, int64_t x_stride, int rows, const float *packed,
                        const float *bias, float *out, int64_t out_stride, int64_t n, int64_t k,
                        int num_threads) {
    if (!x || !packed || !out || rows < 1 || rows > STREAM_MAX_ROWS || n < V || n % V ||
        k < 1 || x_stride < k || out_stride < n)
        return KVLAB_EARG;
    Stream s = {.x = x, .w = packed, .bias = bias, .out = out, .x_stride = x_stride,
                .out_stride = out_stride, .n = n, .k = k, .rows = rows};
    const int64_t count = n / V;
    const int threads = num_threads < 1 ? 1 : num_threads;
    s.tasks = (int)(count < threads * TASKS_PER_THREAD ? count : threads * TASKS_PER_THREAD);
    return kvlab_run_parallel(threads < s.tasks ? threads : s.tasks, stream_tasks, &s);
}
