/* Paged decode attention on the CPU: K/V read in place from the KV pool through slots.
 *
 * Plain C (GNU vector extensions, no torch headers; cpu_common.h): kernels/cpu_build.py
 * compiles it once per machine and kernels/cpu_decode.py calls kvlab_paged_decode
 * through ctypes.
 *
 * One task is one chunk of CHUNK positions of one sequence b, for all its heads: a slot's
 * K for every kv head (kv_heads * head_dim values) lies in one contiguous record, and so
 * does its V, so each task reads its K records, then its V records, front to back, and
 * every K and V value is loaded from memory once and used for the g = heads / kv_heads
 * query heads that share its kv head.
 *   1. scores s[h][j] = scale * q_h . k_j for every query head h and position j of the
 *      chunk, k_j being the record of slot slots[b][j] (positions >= len are never read);
 *   2. softmax of each score row in fp32: subtract its max, exp, sum;
 *   3. acc[h] = sum_j p[h][j] v_j in fp32.
 * A sequence of one chunk writes out_h = acc[h] / sum[h] in q's dtype (bf16 rounds to
 * nearest even). A longer one leaves each chunk's (max, sum, acc) behind, and once every
 * task is done they are merged in chunk order (log-sum-exp: scale each chunk by
 * e^(max_c - max)). Chunks depend only on the lengths, never on the thread count, so the
 * result is the same bits for any number of threads.
 *
 * Shared chunks: sequences behind one cached prompt prefix read its positions through the
 * same slots. A whole chunk that up to MAX_MEMBERS sequences read through the same slots
 * is one task for all of them (found by its first slot, then compared slot for slot): each
 * K and V record is loaded once for every member's query heads, the rows of a kv head's
 * heads of all members side by side. Every row's sums run in the same order as alone, so
 * a sequence's result is the same bits with or without company.
 *
 * Speed: decode is memory-bound. Values are vectors of V floats (GNU vector_size; 16 with
 * AVX-512, else 8: cpu_common.h), and K/V elements are widened (bf16, fp16) as they are
 * loaded, never copied. The score pass takes TILE = V positions at a time: for each query
 * head it accumulates TILE dot-product vectors, then sums all TILE of them at once with a
 * tree of two-vector shuffles (log2 V levels), which costs far less than one horizontal
 * sum per dot product. The value pass keeps up to RB heads x VB vectors of accumulators in
 * registers through a tile's TILE positions, each V vector loaded once for those heads.
 * Where the compiler targets AVX512-BF16 (-march=native on a CPU that has it), bf16 q and
 * K with head_dim a multiple of 32 take vdpbf16ps in the score pass: 32 products (exact in
 * fp32, as the widened ones) per instruction, each lane summing a pair, where the widened
 * path loads, widens and multiplies 16 at a time.
 * exp is a range-reduced polynomial (~1 ulp), branch-free. Records PREFETCH_AHEAD
 * positions ahead are prefetched into L1 (blocks are scattered, so the hardware prefetcher
 * cannot guess where the next one starts; eight records of a SmolLM2 layer are 6 KB, well
 * inside L1 beside the tile in use; on the 2-core AMD EPYC, L1 read fp32 records from
 * memory about 9% faster than L2, and eight positions ahead beat 4, 6, 12 and 16).
 * head_dim 64, 96, 128 and 256 get their own fully unrolled copies.
 *
 * Threads: tasks are handed out from a shared atomic counter, so a thread that something
 * else slows down simply takes fewer of them; the calling thread works alongside the
 * helpers of cpu_pool.c.
 *
 * Dtypes: 0 float32, 1 bfloat16, 2 float16 (where the compiler has _Float16).
 * Returns 0, or a KVLAB_E* code.
 */

#include "cpu_common.h"

#if defined(__AVX512BF16__) && V == 16 /* vdpbf16ps: bf16 pairs multiplied, summed in fp32 */
#include <immintrin.h>
#define PAIRS_BUILT 1
#else
#define PAIRS_BUILT 0
#endif

#define TILE V              /* positions per step of both passes (sum_lanes sums V vectors) */
#define CHUNK 256           /* positions per task; a multiple of TILE */
#define MIN_PARALLEL 1024   /* below this many (position, kv head) pairs, run inline */
#define PREFETCH_AHEAD 8    /* positions ahead whose K/V records are prefetched (to L1) */
#define RB 4                /* query heads of one kv head scored (and summed) together */
#define VB 4                /* vectors of head_dim one value block sums in registers */
#define MAX_MEMBERS 16      /* sequences one task serves from a chunk they share */

typedef struct {
    const void *q, *k, *v;
    void *out;
    int dtype_q, dtype_kv;
    const int64_t *slots;
    int64_t slots_stride;
    const int64_t *lens;
    int64_t max_len;
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    int batch, heads, kv_heads, head_dim, group;
    float scale;
    /* chunk c of sequence b is partial result first_chunk[b] + c (chunks in all); a task
     * is one chunk of one sequence or of several whose slots there are the same: task t
     * is chunk task_chunk[t] of sequences task_seqs[task_start[t] .. task_start[t + 1]) */
    int tasks, chunks, most_members;
    int *first_chunk, *task_start, *task_chunk, *task_seqs; /* (batch + 1,), (tasks + 1,), .. */
    float *partial; /* per chunk of a multi-chunk sequence: (heads, head_dim + 2) */
    const float *prior_out;     /* cascade: (B, heads, head_dim) fp32 over a shared prefix, */
    const float *prior_lse;     /* (B, heads) its log-sum-exp, merged in first; else NULL */
    int next_task;              /* the shared counter threads take tasks from */
} Problem;

typedef struct {        /* one thread's scratch, all fp32, for a task's m sequences */
    float *q;           /* (kv_heads, m, group, head_dim): each kv head's rows side by side */
    float *acc;         /* likewise */
    float *scores;      /* (kv_heads, m, group, CHUNK) */
    float *maxes, *sums; /* (kv_heads, m, group) */
    uint16_t *q_bf16;    /* q's bf16 values in q's layout, for the pairs path */
} Scratch;

/* ---- vector helpers ----------------------------------------------------------------- */

/* lane t of the result = the sum of the lanes of x[t], for TILE (V) vectors: each level
 * adds pairs of vectors after interleaving their halves, quarters, pairs, then lanes, so
 * every add serves all V sums. */
static ALWAYS_INLINE vf sum_lanes(const vf *x) {
#if V == 8
    vf l1[4], l2[2];
    for (int i = 0; i < 4; i++) /* [x0 halves | x1 halves]: 4-lane partial sums */
        l1[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                SHUFFLE(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* 2-lane partial sums of 4 vectors */
        l2[i] = SHUFFLE(l1[2 * i], l1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                SHUFFLE(l1[2 * i], l1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           SHUFFLE(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    vf l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) /* [x0 halves | x1 halves]: 8-lane partial sums */
        l1[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                        21, 22, 23) +
                SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                        28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* 4-lane partial sums of 4 vectors */
        l2[i] = SHUFFLE(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                        24, 25, 26, 27) +
                SHUFFLE(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                        28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* 2-lane partial sums of 8 vectors */
        l3[i] = SHUFFLE(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                        24, 25, 28, 29) +
                SHUFFLE(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23,
                        26, 27, 30, 31);
    return SHUFFLE(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}

static float max_of(const float *x, int n) {
    float lane[V];
    for (int i = 0; i < V; i++) lane[i] = x[0];
    int j = 0;
    for (; j + V <= n; j += V)
        for (int i = 0; i < V; i++) lane[i] = x[j + i] > lane[i] ? x[j + i] : lane[i];
    for (; j < n; j++) lane[0] = x[j] > lane[0] ? x[j] : lane[0];
    float m = lane[0];
    for (int i = 1; i < V; i++) m = lane[i] > m ? lane[i] : m;
    return m;
}

/* x[j] <- e^(x[j] - m) for j < n; returns the sum. */
static float exp_shifted(float *x, int n, float m) {
    float lane[V] = {0};
    int j = 0;
    for (; j + V <= n; j += V)
        for (int i = 0; i < V; i++) {
            x[j + i] = fast_exp(x[j + i] - m);
            lane[i] += x[j + i];
        }
    for (; j < n; j++) {
        x[j] = fast_exp(x[j] - m);
        lane[0] += x[j];
    }
    float sum = 0.0f;
    for (int i = 0; i < V; i++) sum += lane[i];
    return sum;
}

/* ---- one task: positions [j0, j0 + n) of sequence b, every head ---------------------- */

/* The task's functions are inlined into run_task's cases, so head_dim and the cache
 * dtype are constants there: the loops over head_dim unroll and the dtype branches go. */

static ALWAYS_INLINE void prefetch_record(const void *base, int dtype, int64_t offset,
                                          int64_t count) {
#if defined(__GNUC__)
    const int64_t size = dtype == DT_F32 ? 4 : 2;
    const char *at = (const char *)base + offset * size;
    for (int64_t byte = 0; byte < count * size; byte += 64) __builtin_prefetch(at + byte, 0, 3);
#else
    (void)base, (void)dtype, (void)offset, (void)count;
#endif
}

/* rows[t]: the record offsets of positions j .. j + TILE - 1 of the task (of the last
 * position n - 1 past its end, so a partial tile still reads only the sequence's slots);
 * prefetches the records PREFETCH_AHEAD positions on. */
static ALWAYS_INLINE void tile_rows(const int64_t *slots, int j, int n, int64_t stride,
                                    const void *base, int dtype, int64_t record,
                                    int64_t *rows) {
    for (int t = 0; t < TILE; t++) {
        const int at = j + t < n ? j + t : n - 1;
        rows[t] = slots[at] * stride;
        if (j + t + PREFETCH_AHEAD < n)
            prefetch_record(base, dtype, slots[j + t + PREFETCH_AHEAD] * stride,
                            record);
    }
}

/* scores[h][j .. j + TILE) for the nr (<= RB) query heads h0 .. h0 + nr - 1 of one kv
 * head, whose K records start at rows[t] + head: each K vector is loaded (and widened)
 * once for all nr heads. */
static ALWAYS_INLINE void score_heads(const Problem *p, const int64_t *rows, int64_t head,
                                      int h0, int nr, int j, int n, Scratch *s, int d,
                                      int dtype, int pairs) {
    const int vec_end = d / V * V;
    vf dots[RB][TILE];
#if PAIRS_BUILT
    if (pairs) { /* bf16 q and K, d a multiple of 32: 32 products per instruction, each
                  * lane summing a pair of them in fp32 (exact products, as below) */
        for (int t = 0; t < TILE; t++) {
            __m512 x[RB];
            for (int i = 0; i < nr; i++) x[i] = _mm512_setzero_ps();
            for (int c = 0; c < d; c += 32) {
                const __m512bh kc = (__m512bh)_mm512_loadu_si512(
                    (const uint16_t *)p->k + rows[t] + head + c);
                for (int i = 0; i < nr; i++)
                    x[i] = _mm512_dpbf16_ps(x[i], (__m512bh)_mm512_loadu_si512(
                                                      s->q_bf16 + (int64_t)(h0 + i) * d + c),
                                            kc);
            }
            for (int i = 0; i < nr; i++) dots[i][t] = (vf)x[i];
        }
    } else
#else
    (void)pairs;
#endif
    for (int t = 0; t < TILE; t++) {
        vf x[RB];
        for (int i = 0; i < nr; i++) x[i] = (vf){0};
        for (int c = 0; c < vec_end; c += V) {
            const vf kc = load_v(p->k, dtype, rows[t] + head + c);
            for (int i = 0; i < nr; i++) {
                x[i] += load_f(s->q + (int64_t)(h0 + i) * d + c) * kc;
            }
        }
        for (int i = 0; i < nr; i++) dots[i][t] = x[i];
    }
    for (int i = 0; i < nr; i++) {
        const float *q = s->q + (int64_t)(h0 + i) * d;
        vf sums = sum_lanes(dots[i]);
        for (int c = vec_end; c < d; c++) /* head_dim off the vector width */
            for (int t = 0; t < TILE; t++) sums[t] += q[c] * load(p->k, dtype, rows[t] + head + c);
        sums *= p->scale;
        float *out = s->scores + (int64_t)(h0 + i) * CHUNK + j;
        if (j + TILE <= n) memcpy(out, &sums, sizeof sums);
        else
            for (int t = 0; t < n - j; t++) out[t] = sums[t];
    }
}

/* scores[h][j] = scale * q_h . k_j for the n positions j of the task */
static ALWAYS_INLINE void score_pass(const Problem *p, const int64_t *slots, int n,
                                     Scratch *s, int d, int dtype, int g, int pairs) {
    const int kv_heads = p->kv_heads;
    const int64_t stride = p->k_slot_stride, head_stride = p->k_head_stride;
    const int64_t record = (kv_heads - 1) * head_stride + d;
    for (int j = 0; j < n; j += TILE) {
        int64_t rows[TILE];
        tile_rows(slots, j, n, stride, p->k, p->dtype_kv, record, rows);
        for (int kvh = 0; kvh < kv_heads; kvh++) {
            const int64_t head = kvh * head_stride;
            for (int r = 0; r < g; r += RB) {
                const int h = kvh * g + r;
                switch (g - r) { /* a constant count keeps the heads' sums in registers */
                case 1: score_heads(p, rows, head, h, 1, j, n, s, d, dtype, pairs); break;
                case 2: score_heads(p, rows, head, h, 2, j, n, s, d, dtype, pairs); break;
                case 3: score_heads(p, rows, head, h, 3, j, n, s, d, dtype, pairs); break;
                default: score_heads(p, rows, head, h, RB, j, n, s, d, dtype, pairs); break;
                }
            }
        }
    }
}

/* acc[h0 + i][c .. c + nw V) += sum_{t < m} w[h0 + i][t] v_t for i < nr (<= RB) heads of
 * one kv head: the nr x nw sums stay in registers through the tile's positions, each V
 * vector loaded (and widened) once for all nr heads; every sum runs in position order. */
static ALWAYS_INLINE void accumulate_block(const Problem *p, Scratch *s, const int64_t *rows,
                                           int64_t head, int h0, int nr, int c, int nw, int j,
                                           int m, int d, int dtype) {
    vf a[RB][VB];
    for (int i = 0; i < nr; i++)
        for (int w = 0; w < nw; w++) a[i][w] = load_f(s->acc + (int64_t)(h0 + i) * d + c + w * V);
    for (int t = 0; t < m; t++) {
        vf vt[VB];
        for (int w = 0; w < nw; w++) vt[w] = load_v(p->v, dtype, rows[t] + head + c + w * V);
        for (int i = 0; i < nr; i++) {
            const float x = s->scores[(int64_t)(h0 + i) * CHUNK + j + t];
            for (int w = 0; w < nw; w++) a[i][w] += x * vt[w];
        }
    }
    for (int i = 0; i < nr; i++)
        for (int w = 0; w < nw; w++) store_f(s->acc + (int64_t)(h0 + i) * d + c + w * V, a[i][w]);
}

/* accumulate_block for the g heads of one kv head, RB at a time (a constant count keeps
 * the sums in registers) */
static ALWAYS_INLINE void accumulate_heads(const Problem *p, Scratch *s, const int64_t *rows,
                                           int64_t head, int h, int g, int c, int nw, int j,
                                           int m, int d, int dtype) {
    for (int r = 0; r < g; r += RB) {
        switch (g - r) {
        case 1: accumulate_block(p, s, rows, head, h + r, 1, c, nw, j, m, d, dtype); break;
        case 2: accumulate_block(p, s, rows, head, h + r, 2, c, nw, j, m, d, dtype); break;
        case 3: accumulate_block(p, s, rows, head, h + r, 3, c, nw, j, m, d, dtype); break;
        default: accumulate_block(p, s, rows, head, h + r, RB, c, nw, j, m, d, dtype); break;
        }
    }
}

/* acc[h] += sum_{t < m} w[h][t] v_t over the rows of one tile, for every head */
static ALWAYS_INLINE void accumulate(const Problem *p, Scratch *s, const int64_t *rows, int j,
                                     int m, int d, int dtype, int g) {
    const int vec_end = d / V * V;
    for (int kvh = 0; kvh < p->kv_heads; kvh++) {
        const int64_t head = kvh * p->v_head_stride;
        int c = 0;
        for (; c + VB * V <= vec_end; c += VB * V)
            accumulate_heads(p, s, rows, head, kvh * g, g, c, VB, j, m, d, dtype);
        for (; c < vec_end; c += V)
            accumulate_heads(p, s, rows, head, kvh * g, g, c, 1, j, m, d, dtype);
        for (int c = vec_end; c < d; c++) /* head_dim off the vector width */
            for (int r = 0; r < g; r++) {
                const int h = kvh * g + r;
                const float *w = s->scores + (int64_t)h * CHUNK + j;
                float x = s->acc[(int64_t)h * d + c];
                for (int t = 0; t < m; t++) x += w[t] * load(p->v, dtype, rows[t] + head + c);
                s->acc[(int64_t)h * d + c] = x;
            }
    }
}

/* acc[h] = sum_j scores[h][j] v_j over the n positions of the task */
static ALWAYS_INLINE void value_pass(const Problem *p, const int64_t *slots, int n, Scratch *s,
                                     int d, int dtype, int g) {
    const int64_t stride = p->v_slot_stride;
    const int64_t record = (p->kv_heads - 1) * p->v_head_stride + d;
    memset(s->acc, 0, sizeof(float) * (size_t)(p->kv_heads * g) * (size_t)d);
    for (int j = 0; j < n; j += TILE) {
        int64_t rows[TILE];
        tile_rows(slots, j, n, stride, p->v, p->dtype_kv, record, rows);
        if (j + TILE <= n) accumulate(p, s, rows, j, TILE, d, dtype, g);
        else accumulate(p, s, rows, j, n - j, d, dtype, g);
    }
}

static ALWAYS_INLINE void task_body(Problem *p, int task, Scratch *s, int d, int dtype) {
    const int *seqs = p->task_seqs + p->task_start[task];
    const int m = p->task_start[task + 1] - p->task_start[task], chunk = p->task_chunk[task];
    const int j0 = chunk * CHUNK, len = (int)p->lens[seqs[0]]; /* every member's, if m > 1 */
    const int n = len - j0 < CHUNK ? len - j0 : CHUNK, heads = p->heads, g = p->group;
    const int gm = g * m, rows = p->kv_heads * gm; /* a kv head's rows: g per member */
    const int pairs = PAIRS_BUILT && dtype == DT_BF16 && p->dtype_q == DT_BF16 && d % 32 == 0;
    const int64_t *slots = p->slots + (int64_t)seqs[0] * p->slots_stride + j0;
    for (int i = 0; i < m; i++) /* row (kvh, i, r) is head kvh * g + r of member i */
        for (int h = 0; h < heads; h++) {
            const int64_t from = ((int64_t)seqs[i] * heads + h) * d;
            const int64_t row = ((int64_t)(h / g * m + i) * g + h % g) * d;
            if (pairs) /* the score pass reads q's bf16 values as they are */
                memcpy(s->q_bf16 + row, (const uint16_t *)p->q + from, 2 * (size_t)d);
            else
                for (int c = 0; c < d; c++) s->q[row + c] = load(p->q, p->dtype_q, from + c);
        }
    score_pass(p, slots, n, s, d, dtype, gm, pairs);
    for (int r = 0; r < rows; r++) {
        float *row = s->scores + (int64_t)r * CHUNK;
        s->maxes[r] = max_of(row, n);
        s->sums[r] = exp_shifted(row, n, s->maxes[r]);
    }
    value_pass(p, slots, n, s, d, dtype, gm);
    for (int i = 0; i < m; i++) {
        const int b = seqs[i], chunks = p->first_chunk[b + 1] - p->first_chunk[b];
        const int64_t q_row = (int64_t)b * heads * d;
        /* per head: max, sum, acc */
        float *part = p->partial + ((int64_t)(p->first_chunk[b] + chunk) * heads) * (d + 2);
        for (int h = 0; h < heads; h++) {
            const int r = (h / g * m + i) * g + h % g;
            const float *acc = s->acc + (int64_t)r * d;
            if (chunks == 1 && !p->prior_lse) {
                store(p->out, p->dtype_q, q_row + (int64_t)h * d, acc, 1.0f / s->sums[r], d);
                continue;
            }
            part[(int64_t)h * (d + 2)] = s->maxes[r];
            part[(int64_t)h * (d + 2) + 1] = s->sums[r];
            memcpy(part + (int64_t)h * (d + 2) + 2, acc, sizeof(float) * (size_t)d);
        }
    }
}

static ALWAYS_INLINE void task_dim(Problem *p, int task, Scratch *s, int d) {
    switch (p->dtype_kv) {
    case DT_F32: task_body(p, task, s, d, DT_F32); break;
    case DT_BF16: task_body(p, task, s, d, DT_BF16); break;
    default: task_body(p, task, s, d, DT_F16); break;
    }
}

static void run_task(Problem *p, int task, Scratch *s) {
    switch (p->head_dim) { /* the common head sizes get their own unrolled copies */
    case 64: task_dim(p, task, s, 64); break;
    case 96: task_dim(p, task, s, 96); break;
    case 128: task_dim(p, task, s, 128); break;
    case 256: task_dim(p, task, s, 256); break;
    default: task_dim(p, task, s, p->head_dim); break;
    }
}

/* out for sequence b from its chunks' (max, sum, acc), in chunk order (after the prior's) */
static void merge_chunks(const Problem *p, int b, float *acc) {
    const int d = p->head_dim, heads = p->heads, stride = heads * (d + 2);
    const int first = p->first_chunk[b], last = p->first_chunk[b + 1];
    for (int h = 0; h < heads; h++) {
        const float *part = p->partial + (int64_t)first * stride + (int64_t)h * (d + 2);
        const int64_t row = (int64_t)b * heads + h;
        float m = part[0], sum = 0.0f;
        for (int t = 1; t < last - first; t++) m = part[t * stride] > m ? part[t * stride] : m;
        memset(acc, 0, sizeof(float) * (size_t)d);
        if (p->prior_lse) { /* the prefix's part: sum 1 and acc = its output at max lse */
            const float lse = p->prior_lse[row], *prior = p->prior_out + row * d;
            m = lse > m ? lse : m;
            sum = fast_exp(lse - m);
            for (int c = 0; c < d; c++) acc[c] = sum * prior[c];
        }
        for (int t = first; t < last; t++, part += stride) {
            const float w = fast_exp(part[0] - m);
            sum += w * part[1];
            for (int c = 0; c < d; c++) acc[c] += w * part[2 + c];
        }
        store(p->out, p->dtype_q, row * d, acc, 1.0f / sum, d);
    }
}

/* ---- threads ---------------------------------------------------------------------- */

/* Every task until the counter runs out; KVLAB_ENOMEM when there is no scratch. */
static int take_tasks(Problem *p) {
    const size_t rows = (size_t)p->heads * (size_t)p->most_members;
    const size_t hd = rows * (size_t)p->head_dim;
    float *buf = malloc(sizeof(float) * (2 * hd + rows * (CHUNK + 2)) + 2 * hd);
    if (!buf) return KVLAB_ENOMEM;
    float *scores = buf + 2 * hd, *maxes = scores + rows * CHUNK;
    Scratch s = {buf, buf + hd, scores, maxes, maxes + rows, (uint16_t *)(maxes + 2 * rows)};
    for (;;) {
        const int t = __atomic_fetch_add(&p->next_task, 1, __ATOMIC_RELAXED);
        if (t >= p->tasks) break;
        run_task(p, t, &s);
    }
    free(buf);
    return KVLAB_OK;
}

static int thread_count(const Problem *p, int wanted) {
    int64_t work = 0;
    for (int b = 0; b < p->batch; b++) work += p->lens[b] * p->kv_heads;
    int n = wanted < p->tasks ? wanted : p->tasks;
    n = n < MAX_THREADS ? n : MAX_THREADS;
    return work < MIN_PARALLEL || n < 1 ? 1 : n;
}

static int take_tasks_work(void *p) { return take_tasks((Problem *)p); }

/* Every task, on this thread and n - 1 pool helpers, taking them from a shared counter. */
static int run_all(Problem *p, int num_threads) {
    const int n = thread_count(p, num_threads);
    return n == 1 ? take_tasks(p) : kvlab_run_parallel(n, take_tasks_work, p);
}

/* Whether chunk c of sequences a and b is whole in both and reads the same slots. */
static int same_chunk(const Problem *p, int a, int b, int c) {
    const int64_t end = (int64_t)(c + 1) * CHUNK;
    if (p->lens[a] < end || p->lens[b] < end) return 0;
    const int64_t *x = p->slots + a * p->slots_stride + c * CHUNK;
    const int64_t *y = p->slots + b * p->slots_stride + c * CHUNK;
    return x[0] == y[0] && memcmp(x, y, sizeof(int64_t) * CHUNK) == 0;
}

/* The tasks: every chunk of every sequence, a chunk that several sequences read through
 * the same slots (a shared prompt prefix's) one task for up to MAX_MEMBERS of them, so its
 * K/V are read once for all. Chunk by chunk, each whole one looked up by its first slot in
 * a small hash table of the chunk's tasks so far. task_of (2 chunks,) is scratch. Returns
 * KVLAB_ENOMEM when there is no room for the table. */
static int make_tasks(Problem *p, int *task_of) {
    int size = 16, tasks = 0, most_chunks = 0;
    while (size < 2 * p->batch) size *= 2;
    int *table = malloc(sizeof(int) * (size_t)size); /* task ids, -1 empty */
    if (!table) return KVLAB_ENOMEM;
    int *leader = p->task_seqs; /* each task's first sequence, until the fill below */
    p->most_members = 1;
    for (int b = 0; b < p->batch; b++) {
        const int n = p->first_chunk[b + 1] - p->first_chunk[b];
        most_chunks = n > most_chunks ? n : most_chunks;
    }
    for (int c = 0; c < most_chunks; c++) {
        for (int i = 0; i < size; i++) table[i] = -1;
        for (int b = 0; b < p->batch; b++) {
            if (c >= p->first_chunk[b + 1] - p->first_chunk[b]) continue;
            int t = -1;
            if (p->lens[b] >= (int64_t)(c + 1) * CHUNK) { /* a whole chunk: shared? */
                const uint64_t key = (uint64_t)p->slots[b * p->slots_stride + c * CHUNK];
                int at = (int)((key * 0x9E3779B97F4A7C15ull) >> 40) & (size - 1);
                for (; table[at] >= 0; at = (at + 1) & (size - 1)) {
                    const int u = table[at];
                    if (p->task_start[u] < MAX_MEMBERS && same_chunk(p, leader[u], b, c)) {
                        t = u;
                        break;
                    }
                }
                if (t < 0) table[at] = tasks; /* the next task, made below */
            }
            if (t < 0) {
                t = tasks++;
                p->task_chunk[t] = c;
                p->task_start[t] = 0; /* members so far */
                leader[t] = b;
            }
            task_of[p->first_chunk[b] + c] = t;
            if (++p->task_start[t] > p->most_members) p->most_members = p->task_start[t];
        }
    }
    free(table);
    int at = 0; /* counts to starts, then each sequence's chunks into its task */
    for (int t = 0; t < tasks; t++) {
        const int count = p->task_start[t];
        p->task_start[t] = at;
        at += count;
    }
    p->task_start[tasks] = at;
    int *next = task_of + p->chunks; /* (tasks,) fill positions */
    memcpy(next, p->task_start, sizeof(int) * (size_t)tasks);
    for (int b = 0; b < p->batch; b++)
        for (int c = 0; c < p->first_chunk[b + 1] - p->first_chunk[b]; c++)
            p->task_seqs[next[task_of[p->first_chunk[b] + c]]++] = b;
    p->tasks = tasks;
    return KVLAB_OK;
}

/* The tasks and the partial results' buffer, then every task, then the merges. */
static int run_problem(Problem *p, int num_threads) {
    int64_t chunks = 0, partials = 0;
    for (int b = 0; b < p->batch; b++) {
        const int64_t n = (p->lens[b] + CHUNK - 1) / CHUNK;
        chunks += n;
        partials += n > 1 || p->prior_lse ? n : 0;
    }
    if (chunks > INT32_MAX / 4) return KVLAB_EARG;
    p->chunks = (int)chunks;
    /* first_chunk (batch + 1), task_start (chunks + 1), task_chunk, task_seqs, task_of and
     * its fill positions (chunks each) */
    int *ints = malloc(sizeof(int) * ((size_t)p->batch + 2 + 5 * (size_t)chunks));
    p->partial = partials ? malloc(sizeof(float) * (size_t)chunks * (size_t)p->heads *
                                   (size_t)(p->head_dim + 2))
                          : NULL;
    float *acc = malloc(sizeof(float) * (size_t)p->head_dim);
    int status = KVLAB_ENOMEM;
    if (ints && acc && (p->partial || !partials)) {
        p->first_chunk = ints;
        p->task_start = ints + p->batch + 1;
        p->task_chunk = p->task_start + chunks + 1;
        p->task_seqs = p->task_chunk + chunks;
        int at = 0;
        for (int b = 0; b < p->batch; b++) {
            p->first_chunk[b] = at;
            at += (int)((p->lens[b] + CHUNK - 1) / CHUNK);
        }
        p->first_chunk[p->batch] = at;
        status = make_tasks(p, p->task_seqs + chunks);
        p->next_task = 0;
        if (status == KVLAB_OK) status = run_all(p, num_threads);
        for (int b = 0; status == KVLAB_OK && b < p->batch; b++)
            if (p->first_chunk[b + 1] - p->first_chunk[b] > 1 || p->prior_lse)
                merge_chunks(p, b, acc);
    }
    free(ints);
    free(p->partial);
    free(acc);
    return status;
}

/* ---- entry point ------------------------------------------------------------------ */

/* Every index the kernel forms stays inside the arrays it was given: checked here, before
 * anything is written (only running out of memory can stop it later). */
static int check_args(const Problem *p, int64_t num_slots) {
    if (p->batch < 0 || p->heads < 1 || p->heads > MAX_HEADS || p->kv_heads < 1) return KVLAB_EARG;
    if (p->heads % p->kv_heads || (int64_t)p->batch * p->kv_heads > INT32_MAX) return KVLAB_EARG;
    if (p->head_dim < 1 || p->head_dim > MAX_HEAD_DIM) return KVLAB_EARG;
    if (!dtype_ok(p->dtype_q) || !dtype_ok(p->dtype_kv)) return KVLAB_EARG;
    if (p->batch == 0) return KVLAB_OK;
    if (!p->q || !p->k || !p->v || !p->out || !p->slots || !p->lens) return KVLAB_EARG;
    if (p->max_len < 1 || p->max_len > INT32_MAX || p->slots_stride < 0) return KVLAB_EARG;
    if (p->k_slot_stride < 0 || p->k_head_stride < 0) return KVLAB_EARG;
    if (p->v_slot_stride < 0 || p->v_head_stride < 0) return KVLAB_EARG;
    for (int b = 0; b < p->batch; b++) {
        const int64_t len = p->lens[b], *slots = p->slots + (int64_t)b * p->slots_stride;
        if (len < 1 || len > p->max_len) return KVLAB_ELEN;
        for (int64_t j = 0; j < len; j++)
            if (slots[j] < 0 || slots[j] >= num_slots) return KVLAB_ESLOT;
    }
    return KVLAB_OK;
}

/* 1 when the library handles this dtype code (float16 needs the compiler's _Float16). */
int kvlab_dtype_supported(int dtype) { return dtype_ok(dtype); }

/* MAX_MEMBERS: the sequences one task serves from a chunk they share (the cascade rule,
 * kernels/cpu_cascade.py, reads it here). */
int kvlab_decode_members(void) { return MAX_MEMBERS; }

/* q, out: (B, heads, head_dim) contiguous; k, v: (num_slots, kv_heads, head_dim) with
 * the given element strides, last dim contiguous; slots: (B, max_len) with row stride
 * slots_stride; lens: (B,) each in [1, max_len]. prior_out (B, heads, head_dim) and
 * prior_lse (B, heads), fp32, or both NULL: the attention each row already has over other
 * positions (cascade attention's shared prefix, kvlab_prefix_amx), merged into out. */
int kvlab_paged_decode(const void *q, const void *k, const void *v, void *out, int dtype_q,
                       int dtype_kv, const int64_t *slots, int64_t slots_stride,
                       const int64_t *lens, int64_t max_len, int64_t num_slots,
                       int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                       int64_t v_head_stride, int B, int heads, int kv_heads, int head_dim,
                       float scale, const float *prior_out, const float *prior_lse,
                       int num_threads) {
    Problem p = {q, k, v, out, dtype_q, dtype_kv, slots, slots_stride, lens, max_len,
                 k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                 B, heads, kv_heads, head_dim, kv_heads > 0 ? heads / kv_heads : 0, scale,
                 0, 0, 1, NULL, NULL, NULL, NULL, NULL, prior_out, prior_lse, 0};
    if (!prior_out != !prior_lse) return KVLAB_EARG;
    int status = check_args(&p, num_slots);
    if (status != KVLAB_OK || B == 0) return status;
    return run_problem(&p, num_threads);
}
