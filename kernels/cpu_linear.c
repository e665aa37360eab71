/* A decode step's linear layers in bf16 on AMX tiles: y = x W^T (+ b) for up to 32 rows.
 *
 * With a few rows a linear layer is a stream of its weights: each weight is read once and
 * multiplied by every row, so the step takes as long as reading W from memory. The weights
 * are packed once (kvlab_linear_pack) into the order the kernel reads them, one sequential
 * stream per pair of 16-column blocks:
 *
 *   tile (pair jp, k step s, half h)   row p, pair c = W[32 jp + 16 h + c][32 s + 2 p .. + 1]
 *
 * each tile 16 rows of 64 bytes ("VNNI": W^T's pairs of bf16 side by side in 32 bits), the
 * two halves of a step side by side. A task is a run of consecutive column pairs: for each,
 * the rows (tmm4, and tmm5 past 16 rows) times the two halves (tmm6-7) add into 16 x 16 fp32
 * tiles (tmm0-1, tmm2-3 past 16 rows) over K / 32 steps (tdpbf16ps), then the bias is added
 * in fp32 and each output rounded to bf16 (vcvtneps2bf16, nearest even).
 *
 * Every output is one fp32 sum in a fixed order of its row and column alone, so the result
 * is the same bits for any thread count and any rows beside it. N and K multiples of 32.
 * Built where the compiler knows AMX (cpu_amx.h); run where kvlab_amx_ready() is 1.
 */

#include "cpu_amx.h"
#include "cpu_common.h"

#define LINEAR_MAX_ROWS 32
#define TASKS_PER_THREAD 4 /* runs of column pairs a thread takes, for balance */

/* W (N, K) bf16, row stride w_stride elements -> packed (N * K elements, the layout above). */
int kvlab_linear_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                      uint16_t *packed) {
    if (!w || !packed || n < 32 || k < 32 || n % 32 || k % 32 || w_stride < k) return KVLAB_EARG;
    const int64_t steps = k / 32;
    for (int64_t jp = 0; jp < n / 32; jp++)
        for (int64_t s = 0; s < steps; s++)
            for (int h = 0; h < 2; h++) {
                uint16_t *tile = packed + ((jp * steps + s) * 2 + h) * TILE;
                for (int p = 0; p < 16; p++)
                    for (int c = 0; c < 16; c++) {
                        const uint16_t *src = w + (32 * jp + 16 * h + c) * w_stride + 32 * s + 2 * p;
                        tile[p * 32 + c * 2] = src[0];
                        tile[p * 32 + c * 2 + 1] = src[1];
                    }
            }
    return KVLAB_OK;
}

#if KVLAB_AMX_BUILT

typedef struct {
    const uint16_t *x, *w, *bias;
    uint16_t *out;
    int64_t x_stride, out_stride, n, k;
    int rows, tasks, next_task;
} Linear;

/* Column pairs jp0 .. jp1 - 1 of the output: tiles as the header says. */
AMX static void column_pairs(const Linear *l, int64_t jp0, int64_t jp1) {
    const int64_t steps = l->k / 32, lda = l->x_stride * 2;
    const int two = l->rows > 16; /* a second block of 16 rows */
    float acc[32 * 32];           /* (rows, 32 columns) fp32 */
    for (int64_t jp = jp0; jp < jp1; jp++) {
        const uint16_t *b = l->w + jp * steps * 2 * TILE;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++, b += 2 * TILE) {
            _tile_loadd(4, l->x + s * 32, lda);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, l->x + 16 * l->x_stride + s * 32, lda);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, acc, 32 * 4);
        _tile_stored(1, acc + 16, 32 * 4);
        if (two) {
            _tile_stored(2, acc + 16 * 32, 32 * 4);
            _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
        }
        const int64_t c0 = jp * 32;
        __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
        if (l->bias) {
            const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(l->bias + c0)));
            const __m512i raw1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(l->bias + c0 + 16)));
            bias0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
            bias1 = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
        }
        for (int r = 0; r < l->rows; r++) {
            uint16_t *y = l->out + r * l->out_stride + c0;
            const __m256bh y0 = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + r * 32), bias0));
            const __m256bh y1 = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + r * 32 + 16), bias1));
            _mm256_storeu_si256((void *)y, (__m256i)y0);
            _mm256_storeu_si256((void *)(y + 16), (__m256i)y1);
        }
    }
}

AMX static int linear_tasks(void *arg) {
    Linear *l = arg;
    const int top = l->rows < 16 ? l->rows : 16, rest = l->rows - top;
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = (uint8_t)top;
    config.rows[2] = config.rows[3] = config.rows[5] = (uint8_t)(rest > 0 ? rest : 1);
    config.rows[6] = config.rows[7] = 16;
    _tile_loadconfig(&config);
    const int64_t pairs = l->n / 32;
    for (;;) {
        const int task = __atomic_fetch_add(&l->next_task, 1, __ATOMIC_RELAXED);
        if (task >= l->tasks) break;
        column_pairs(l, pairs * task / l->tasks, pairs * (task + 1) / l->tasks);
    }
    _tile_release();
    return KVLAB_OK;
}

#endif

/* x (rows, K) bf16, row stride x_stride; packed: kvlab_linear_pack's W (N, K); bias (N,)
 * bf16 or NULL; out (rows, N) bf16, row stride out_stride. Returns 0, or a KVLAB_E* code
 * (KVLAB_ENOAMX where kvlab_amx_ready() is 0). */
int kvlab_linear_amx(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *packed,
                     const uint16_t *bias, uint16_t *out, int64_t out_stride, int64_t n,
                     int64_t k, int num_threads) {
#if KVLAB_AMX_BUILT
    if (!kvlab_amx_ready()) return KVLAB_ENOAMX;
    if (!x || !packed || !out || rows < 1 || rows > LINEAR_MAX_ROWS || n < 32 || k < 32 ||
        n % 32 || k % 32 || x_stride < k || out_stride < n)
        return KVLAB_EARG;
    Linear l = {.x = x, .w = packed, .bias = bias, .out = out, .x_stride = x_stride,
                .out_stride = out_stride, .n = n, .k = k, .rows = rows};
    const int64_t pairs = n / 32;
    const int threads = num_threads < 1 ? 1 : num_threads;
    l.tasks = (int)(pairs < threads * TASKS_PER_THREAD ? pairs : threads * TASKS_PER_THREAD);
    return kvlab_run_parallel(threads < l.tasks ? threads : l.tasks, linear_tasks, &l);
#else
    (void)x, (void)x_stride, (void)rows, (void)packed, (void)bias, (void)out;
    (void)out_stride, (void)n, (void)k, (void)num_threads;
    return KVLAB_ENOAMX;
#endif
}
