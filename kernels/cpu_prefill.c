/* Prompt attention on the CPU: Q new query rows of one sequence after P cached positions,
 * K/V read in place from the KV pool through the sequence's slots.
 *
 * Row i of q sits at position P + i and attends causally to positions 0 .. P + i, so one
 * call serves a whole prompt (P = 0), a prompt behind a prefix hit and a later chunk of a
 * chunked prefill alike. kernels/cpu_prefill.py calls kvlab_paged_prefill through ctypes.
 *
 * One task is one kv head and a block of QB query positions. The block's rows are its
 * positions times the g = heads / kv_heads query heads sharing the kv head (row r = i * g +
 * gh), so every K and V value read serves g * QB rows. The task runs flash attention over
 * chunks of KC positions up to its last row's causal end, in the register tiles of
 * cpu_tiles.h (bf16 rows over bf16 K scored in pairs where the build has AVX512-BF16), K
 * and V read in place from the pool (no copy is made), then writes
 * out[r] = acc[r] / sum[r] in q's dtype (bf16 rounds to nearest even).
 * The blocks with the most positions (the last) are handed out first, from a shared counter
 * (cpu_pool.c). Tasks depend only on the shapes, never on the thread count, so the result
 * is the same bits for any number of threads.
 *
 * kvlab_paged_prefill_batch runs several sequences' rows in one call (a whole step: prompts,
 * chunks and decodes alike, each a sequence of its own), their tasks from one counter; a
 * task computes exactly what it computes in a call of its sequence alone.
 *
 * head_dim must be a multiple of V (16 with AVX-512, else 8). Returns 0, or a KVLAB_E* code.
 */

#include "cpu_tiles.h"

#define QB 16       /* query positions per task */
#define MIN_PARALLEL (1 << 16) /* below this many (query row, position) pairs, run inline */

typedef struct {
    const void *q, *k, *v;
    void *out;
    int dtype_q, dtype_kv;
    const int64_t *slots;        /* (B, slots_stride): position j of sequence b's slot */
    int64_t slots_stride;
    const int64_t *starts;       /* (B + 1,): sequence b's rows are q[starts[b] .. starts[b + 1]) */
    const int64_t *lens;         /* (B,): S_b, its positions (the new rows are the last) */
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    int batch, heads, kv_heads, head_dim, group;
    float scale;
    int tasks;                   /* sum over sequences of query blocks x kv_heads */
    int *first_task;             /* (B + 1,): sequence b's tasks are [first_task[b], ..[b + 1]) */
    int *task_seq;               /* (tasks,): whose task it is */
    int next_task;               /* the shared counter threads take tasks from */
} Problem;

/* ---- one task: kv head kvh, query positions i0 .. i0 + QB - 1 -------------------------- */

static ALWAYS_INLINE void task_body(Problem *p, int task, Tiles *w, int d, int dtype) {
    const int b = p->task_seq[task], local = task - p->first_task[b];
    const int rows_q = (int)(p->starts[b + 1] - p->starts[b]), positions = (int)p->lens[b];
    const int blocks = (rows_q + QB - 1) / QB;
    const int kvh = local % p->kv_heads, block = blocks - 1 - local / p->kv_heads;
    const int g = p->group, i0 = block * QB, P = positions - rows_q;
    const int qn = rows_q - i0 < QB ? rows_q - i0 : QB;
    const int rows = qn * g, stride = w->stride, end = P + i0 + qn;
    const int64_t first = p->starts[b], *slots = p->slots + (int64_t)b * p->slots_stride;
    const uint16_t *q16 = p->q; /* bf16 rows, read as they are for the pairs */
    w->pairs = TILES_PAIRS_BUILT && dtype == DT_BF16 && p->dtype_q == DT_BF16;
    w->scale = p->scale;
    for (int r = 0; r < stride; r++) { /* row r: position i0 + r / g, head kvh * g + r % g */
        const int64_t at = ((first + i0 + r / g) * p->heads + kvh * g + r % g) * d;
        if (r >= rows) /* padding */
            for (int c = 0; c < d; c++) w->qt[c * stride + r] = 0.0f; /* qt2's too */
        else if (w->pairs) /* bf16 pairs, unscaled (cpu_tiles.h) */
            for (int c = 0; c < d; c++) w->qt2[(c / 2 * stride + r) * 2 + c % 2] = q16[at + c];
        else if (p->dtype_q == DT_F32) /* the usual case, its loop free of the dtype's test */
            for (int c = 0; c < d; c++)
                w->qt[c * stride + r] = ((const float *)p->q)[at + c] * p->scale;
        else
            for (int c = 0; c < d; c++)
                w->qt[c * stride + r] = load(p->q, p->dtype_q, at + c) * p->scale;
        w->end[r] = r < rows ? P + i0 + r / g + 1 : 0;
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)stride * (size_t)d);
    const int64_t k_head = kvh * p->k_head_stride, v_head = kvh * p->v_head_stride;
    int64_t k_at[KC], v_at[KC]; /* the chunk's K and V records */
    for (int c0 = 0; c0 < end; c0 += KC) {
        const int n = end - c0 < KC ? end - c0 : KC;
        for (int j = 0; j < n; j++) {
            k_at[j] = slots[c0 + j] * p->k_slot_stride + k_head;
            v_at[j] = slots[c0 + j] * p->v_slot_stride + v_head;
        }
        tiles_chunk(w, p->k, p->v, dtype, k_at, v_at, rows, c0, n, d, c0 + n > P + i0 + 1);
    }
    for (int r = 0; r < rows; r++) {
        const int64_t at = ((first + i0 + r / g) * p->heads + kvh * g + r % g) * d;
        store(p->out, p->dtype_q, at, w->acc + r * d, 1.0f / w->sum[r], d);
    }
}

static ALWAYS_INLINE void task_dim(Problem *p, int task, Tiles *w, int d) {
    switch (p->dtype_kv) {
    case DT_F32: task_body(p, task, w, d, DT_F32); break;
    case DT_BF16: task_body(p, task, w, d, DT_BF16); break;
    default: task_body(p, task, w, d, DT_F16); break;
    }
}

static int take_tasks(void *arg) {
    Problem *p = arg;
    Tiles w = tiles_new(QB * p->group, p->head_dim);
    if (!w.qt) return KVLAB_ENOMEM;
    for (;;) {
        const int t = __atomic_fetch_add(&p->next_task, 1, __ATOMIC_RELAXED);
        if (t >= p->tasks) break;
        if (p->head_dim == 64) task_dim(p, t, &w, 64); /* unrolled for the common sizes */
        else if (p->head_dim == 128) task_dim(p, t, &w, 128);
        else task_dim(p, t, &w, p->head_dim);
    }
    free(w.qt);
    return KVLAB_OK;
}

/* ---- entry point --------------------------------------------------------------------- */

static int check_args(const Problem *p, int64_t num_slots) {
    if (p->heads < 1 || p->heads > MAX_HEADS || p->kv_heads < 1 || p->heads % p->kv_heads)
        return KVLAB_EARG;
    if (p->head_dim < V || p->head_dim > MAX_HEAD_DIM || p->head_dim % V) return KVLAB_EARG;
    if (!dtype_ok(p->dtype_q) || !dtype_ok(p->dtype_kv)) return KVLAB_EARG;
    if (!p->q || !p->k || !p->v || !p->out || !p->slots || !p->starts || !p->lens)
        return KVLAB_EARG;
    if (p->k_slot_stride < 0 || p->k_head_stride < 0) return KVLAB_EARG;
    if (p->v_slot_stride < 0 || p->v_head_stride < 0) return KVLAB_EARG;
    if (p->batch < 1 || p->slots_stride < 0 || p->starts[0] != 0) return KVLAB_EARG;
    for (int b = 0; b < p->batch; b++) {
        const int64_t rows = p->starts[b + 1] - p->starts[b], len = p->lens[b];
        if (rows < 1 || len < rows || len > p->slots_stride || len > INT32_MAX - KC)
            return KVLAB_ELEN;
        for (int64_t j = 0; j < len; j++) {
            const int64_t slot = p->slots[b * p->slots_stride + j];
            if (slot < 0 || slot >= num_slots) return KVLAB_ESLOT;
        }
    }
    return KVLAB_OK;
}

/* The task list, then every task on this thread and up to num_threads - 1 helpers. */
static int run_problem(Problem *p, int num_threads) {
    int64_t tasks = 0, pairs = 0;
    for (int b = 0; b < p->batch; b++) {
        const int64_t rows = p->starts[b + 1] - p->starts[b];
        tasks += (rows + QB - 1) / QB * p->kv_heads;
        pairs += rows * p->lens[b] * p->kv_heads;
    }
    if (tasks > INT32_MAX) return KVLAB_EARG;
    p->tasks = (int)tasks;
    p->first_task = malloc(sizeof(int) * ((size_t)tasks + (size_t)p->batch + 1));
    if (!p->first_task) return KVLAB_ENOMEM;
    p->task_seq = p->first_task + p->batch + 1;
    int t = 0;
    for (int b = 0; b < p->batch; b++) {
        p->first_task[b] = t;
        const int64_t rows = p->starts[b + 1] - p->starts[b];
        for (int64_t i = 0; i < (rows + QB - 1) / QB * p->kv_heads; i++) p->task_seq[t++] = b;
    }
    p->first_task[p->batch] = t;
    p->next_task = 0;
    const int threads = pairs < MIN_PARALLEL ? 1 : num_threads < p->tasks ? num_threads : p->tasks;
    const int status = kvlab_run_parallel(threads, take_tasks, p);
    free(p->first_task);
    return status;
}

/* 1 when this build's register tiles run at the CPU's matmul rate: its target has
 * AVX-512 (tiles of 16-float vectors), or AVX2 with FMA (8-float vectors, cpu_tiles.h).
 * Anything else (no -march=native, another architecture) computes the same result in
 * scalar or split vectors, slower than torch's attention. */
int kvlab_prefill_tiles_fit(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* B sequences at once. q, out: (R, heads, head_dim) contiguous, sequence b's rows at
 * R-rows starts[b] .. starts[b + 1] - 1, at its positions lens[b] - (its rows) ..
 * lens[b] - 1; slots: (B, slots_stride), row b's first lens[b] entries its slots; k, v as
 * above. */
int kvlab_paged_prefill_batch(const void *q, const void *k, const void *v, void *out,
                              int dtype_q, int dtype_kv, const int64_t *slots,
                              int64_t slots_stride, const int64_t *starts, const int64_t *lens,
                              int B, int64_t num_slots, int64_t k_slot_stride,
                              int64_t k_head_stride, int64_t v_slot_stride,
                              int64_t v_head_stride, int heads, int kv_heads, int head_dim,
                              float scale, int num_threads) {
    Problem p = {.q = q, .k = k, .v = v, .out = out, .dtype_q = dtype_q, .dtype_kv = dtype_kv,
                 .slots = slots, .slots_stride = slots_stride, .starts = starts, .lens = lens,
                 .k_slot_stride = k_slot_stride, .k_head_stride = k_head_stride,
                 .v_slot_stride = v_slot_stride, .v_head_stride = v_head_stride, .batch = B,
                 .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim,
                 .group = kv_heads > 0 ? heads / kv_heads : 0, .scale = scale};
    const int status = check_args(&p, num_slots);
    return status != KVLAB_OK ? status : run_problem(&p, num_threads);
}

/* q, out: (Q, heads, head_dim) contiguous, rows at positions S - Q .. S - 1; k, v:
 * (num_slots, kv_heads, head_dim) with the given element strides, last dim contiguous;
 * slots: (S,) contiguous. */
int kvlab_paged_prefill(const void *q, const void *k, const void *v, void *out, int dtype_q,
                        int dtype_kv, const int64_t *slots, int Q, int S, int64_t num_slots,
                        int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                        int64_t v_head_stride, int heads, int kv_heads, int head_dim,
                        float scale, int num_threads) {
    const int64_t starts[2] = {0, Q}, lens[1] = {S};
    if (Q < 1 || S < Q) return KVLAB_ELEN;
    return kvlab_paged_prefill_batch(q, k, v, out, dtype_q, dtype_kv, slots, S, starts, lens, 1,
                                     num_slots, k_slot_stride, k_head_stride, v_slot_stride,
                                     v_head_stride, heads, kv_heads, head_dim, scale,
                                     num_threads);
}
