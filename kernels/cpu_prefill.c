/* Prompt attention on the CPU: Q new query rows of one sequence after P cached positions,
 * K/V read in place from the KV pool through the sequence's slots.
 *
 * Row i of q sits at position P + i and attends causally to positions 0 .. P + i, so one
 * call serves a whole prompt (P = 0), a prompt behind a prefix hit and a later chunk of a
 * chunked prefill alike. kernels/cpu_prefill.py calls kvlab_paged_prefill through ctypes.
 *
 * One task is one kv head and a block of QB query positions. The block's rows are its
 * positions times the g = heads / kv_heads query heads sharing the kv head (row r = i * g +
 * gh), so every K and V value read serves g * QB rows. The task keeps its rows side by side
 * in vectors (lane r % 16 of vector r / 16; `stride` lanes in all) and runs flash
 * attention over chunks of KC positions, up to its last row's causal end:
 *   scores   s[j][r] = (scale q_r) . k_j, in register tiles of MP positions x up to RV row
 *            vectors: each K value, loaded where it lies in the pool (widened from bf16 or
 *            fp16), is broadcast against the rows' query values for its dimension, which
 *            were transposed once per task. No copy of K is made.
 *   softmax  per row vector: lanes whose row ends before position j are masked out; the
 *            running max grows to the chunk's, the running sum and the row's accumulator
 *            are scaled by e^(old - new max), and s[j] becomes the weight e^(s[j] - max)
 *            (the polynomial e^x of cpu_common.h, 16 lanes at a time).
 *   values   acc[r] += w[j][r] v_j, in register tiles of MR rows x 4 vectors of head_dim:
 *            each V vector loaded from the pool once per tile, times MR broadcast weights.
 * Both tiles keep their partial sums in registers, so the loop runs at the CPU's matmul
 * rate. Then out[r] = acc[r] / sum[r] in q's dtype (bf16 rounds to nearest even).
 * The blocks with the most positions (the last) are handed out first, from a shared counter
 * (cpu_pool.c). Tasks depend only on the shapes, never on the thread count, so the result
 * is the same bits for any number of threads.
 *
 * head_dim must be a multiple of V (16). Returns 0, or a KVLAB_E* code.
 */

#include <math.h>

#include "cpu_common.h"

#define QB 16       /* query positions per task */
#define KC 256      /* key positions per chunk of a task's flash loop */
#define MP 6        /* positions per score tile */
#define RV 4        /* row vectors per score tile, at most */
#define MR 6        /* rows per value tile */
#define MIN_PARALLEL (1 << 16) /* below this many (query row, position) pairs, run inline */

typedef struct {
    const void *q, *k, *v;
    void *out;
    int dtype_q, dtype_kv;
    const int64_t *slots;        /* (S,): position j's slot */
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    int rows_q, positions;       /* Q and S */
    int heads, kv_heads, head_dim, group;
    float scale;
    int stride;                  /* lanes per position: a whole block's rows, rounded up
                                    to vectors, then to a multiple of MR */
    int blocks, tasks;           /* query blocks; blocks x kv_heads */
    int next_task;               /* the shared counter threads take tasks from */
} Problem;

typedef struct {  /* one thread's scratch, all fp32 but `end` */
    float *qt;    /* (head_dim, stride): the block's query rows times scale, transposed */
    float *s;     /* (KC, stride): scores, then weights */
    float *acc;   /* (stride, head_dim) */
    float *max, *sum; /* (stride,) */
    int32_t *end; /* (stride,): positions < end[r] are row r's context; 0 for padding */
} Scratch;

/* ---- vector helpers ------------------------------------------------------------------ */

static ALWAYS_INLINE vf vmax(vf a, vf b) {
    const vi more = (vi)(a > b);
    return (vf)(((vi)a & more) | ((vi)b & ~more));
}

/* e^x per lane, as fast_exp */
static ALWAYS_INLINE vf fast_exp_v(vf x) {
    const float round = 12582912.0f; /* 1.5 * 2^23 */
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    const vi below = (vi)(x < lo), above = (vi)(x > hi); /* NaN is neither: it stays */
    x = (vf)(((vi)lo & below) | ((vi)hi & above) | ((vi)x & ~(below | above)));
    const vf t = x * 1.44269504088896341f + round;
    const vf n = t - round;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf e = (vf){0} + 1.9875691500e-4f;
    e = e * r + 1.3981999507e-3f;
    e = e * r + 8.3334519073e-3f;
    e = e * r + 4.1665795894e-2f;
    e = e * r + 1.6666665459e-1f;
    e = e * r + 5.0000001201e-1f;
    e = e * r * r + r + 1.0f;
    vi round_bits;
    const vf round_v = (vf){0} + round;
    memcpy(&round_bits, &round_v, sizeof round_bits);
    const vi bits = ((vi)t - round_bits + 127) << 23; /* 2^n */
    return e * (vf)bits;
}

/* ---- one task: kv head kvh, query positions i0 .. i0 + QB - 1 -------------------------- */

/* s[j + p][16 t ..] = k_(j + p) . qt[:, 16 (v0 + t) ..] for p < count positions (count <=
 * MP), t < nv row vectors (nv <= RV) */
static ALWAYS_INLINE void score_tile(const Problem *p, const float *qt, const int64_t *at,
                                     int d, int dtype, float *s, int v0, int nv, int count) {
    vf acc[MP][RV];
    for (int m = 0; m < MP; m++)
        for (int t = 0; t < RV; t++) acc[m][t] = (vf){0};
    for (int c = 0; c < d; c++) {
        vf q[RV];
        for (int t = 0; t < nv; t++) memcpy(&q[t], qt + c * p->stride + (v0 + t) * V, sizeof(vf));
        for (int m = 0; m < MP; m++) {
            const float x = load(p->k, dtype, at[m] + c);
            for (int t = 0; t < nv; t++) acc[m][t] += x * q[t];
        }
    }
    for (int m = 0; m < count; m++)
        for (int t = 0; t < nv; t++) memcpy(s + m * p->stride + (v0 + t) * V, &acc[m][t], sizeof(vf));
}

/* acc[r0 + r][c ..] += sum_{j < n} w[j][r0 + r] v_j[c ..] for MR rows, W vectors wide */
static ALWAYS_INLINE void value_tile(const Problem *p, const float *w, const int64_t *at,
                                     int d, int dtype, float *acc, int r0, int c, int n, int W) {
    vf a[MR][4];
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) memcpy(&a[r][t], acc + (r0 + r) * d + c + t * V, sizeof(vf));
    for (int j = 0; j < n; j++) {
        vf v[4];
        for (int t = 0; t < W; t++) v[t] = load_v(p->v, dtype, at[j] + c + t * V);
        for (int r = 0; r < MR; r++) {
            const float x = w[j * p->stride + r0 + r];
            for (int t = 0; t < W; t++) a[r][t] += x * v[t];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) memcpy(acc + (r0 + r) * d + c + t * V, &a[r][t], sizeof(vf));
}

/* The chunk's scores at positions c0 .. c0 + n - 1 become weights, row vector by row
 * vector; each row's accumulator is scaled by e^(old max - new max) first. */
static ALWAYS_INLINE void softmax_chunk(const Problem *p, Scratch *w, int vectors, int c0,
                                        int n, int d, int masked) {
    for (int t = 0; t < vectors; t++) {
        vf old_max, top, total = {0};
        vi end;
        memcpy(&old_max, w->max + t * V, sizeof old_max);
        memcpy(&end, w->end + t * V, sizeof end);
        top = old_max;
        for (int j = 0; j < n; j++) {
            vf x;
            memcpy(&x, w->s + j * p->stride + t * V, sizeof x);
            if (masked) {
                const vi seen = (vi){0} + (c0 + j) < end;
                x = (vf)(((vi)x & seen) | ((vi)old_max & ~seen)); /* never above the max */
            }
            top = vmax(x, top);
        }
        const vi empty = (vi)(top == -INFINITY); /* padding, or no position seen yet */
        const vf base = (vf)((vi)top & ~empty);  /* 0 there: no NaN from -inf - -inf */
        const vi had = (vi)(old_max > -INFINITY);
        const vf factor = (vf)((vi)fast_exp_v(old_max - base) & had);
        for (int j = 0; j < n; j++) {
            vf x;
            memcpy(&x, w->s + j * p->stride + t * V, sizeof x);
            vi keep = ~empty;
            if (masked) keep &= (vi){0} + (c0 + j) < end;
            x = (vf)((vi)fast_exp_v(x - base) & keep);
            memcpy(w->s + j * p->stride + t * V, &x, sizeof x);
            total += x;
        }
        vf sum;
        memcpy(&sum, w->sum + t * V, sizeof sum);
        sum = sum * factor + total;
        memcpy(w->sum + t * V, &sum, sizeof sum);
        memcpy(w->max + t * V, &top, sizeof top);
        for (int lane = 0; lane < V; lane++)
            if (factor[lane] != 1.0f)
                for (int c = 0; c < d; c++) w->acc[(t * V + lane) * d + c] *= factor[lane];
    }
}

static ALWAYS_INLINE void task_body(Problem *p, int task, Scratch *w, int d, int dtype) {
    const int kvh = task % p->kv_heads, block = p->blocks - 1 - task / p->kv_heads;
    const int g = p->group, i0 = block * QB, P = p->positions - p->rows_q;
    const int qn = p->rows_q - i0 < QB ? p->rows_q - i0 : QB;
    const int rows = qn * g, vectors = (rows + V - 1) / V, stride = p->stride;
    const int end = P + i0 + qn;
    for (int r = 0; r < stride; r++) {
        const int i = r / g, h = kvh * g + r % g;
        const int64_t at = ((int64_t)(i0 + i) * p->heads + h) * d;
        for (int c = 0; c < d; c++)
            w->qt[c * stride + r] = r < rows ? load(p->q, p->dtype_q, at + c) * p->scale : 0.0f;
        w->end[r] = r < rows ? P + i0 + i + 1 : 0;
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)stride * (size_t)d);
    const int64_t k_head = kvh * p->k_head_stride, v_head = kvh * p->v_head_stride;
    for (int c0 = 0; c0 < end; c0 += KC) {
        const int n = end - c0 < KC ? end - c0 : KC;
        const int64_t *slots = p->slots + c0;
        for (int j = 0; j < n; j += MP) {
            int64_t at[MP]; /* K records of the tile's positions (the last one past n) */
            for (int m = 0; m < MP; m++)
                at[m] = slots[j + m < n ? j + m : n - 1] * p->k_slot_stride + k_head;
            const int count = n - j < MP ? n - j : MP;
            for (int v0 = 0; v0 < vectors; v0 += RV) {
                float *tile = w->s + j * stride;
                switch (vectors - v0) { /* a constant nv keeps the tile in registers */
                case 1: score_tile(p, w->qt, at, d, dtype, tile, v0, 1, count); break;
                case 2: score_tile(p, w->qt, at, d, dtype, tile, v0, 2, count); break;
                case 3: score_tile(p, w->qt, at, d, dtype, tile, v0, 3, count); break;
                default: score_tile(p, w->qt, at, d, dtype, tile, v0, RV, count); break;
                }
            }
        }
        softmax_chunk(p, w, vectors, c0, n, d, c0 + n > P + i0 + 1);
        int64_t at[KC]; /* V records of the chunk's positions */
        for (int j = 0; j < n; j++) at[j] = slots[j] * p->v_slot_stride + v_head;
        for (int r0 = 0; r0 < rows; r0 += MR) {
            int c = 0;
            for (; c + 4 * V <= d; c += 4 * V) value_tile(p, w->s, at, d, dtype, w->acc, r0, c, n, 4);
            for (; c < d; c += V) value_tile(p, w->s, at, d, dtype, w->acc, r0, c, n, 1);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t at = ((int64_t)(i0 + r / g) * p->heads + kvh * g + r % g) * d;
        store(p->out, p->dtype_q, at, w->acc + r * d, 1.0f / w->sum[r], d);
    }
}

static ALWAYS_INLINE void task_dim(Problem *p, int task, Scratch *w, int d) {
    switch (p->dtype_kv) {
    case DT_F32: task_body(p, task, w, d, DT_F32); break;
    case DT_BF16: task_body(p, task, w, d, DT_BF16); break;
    default: task_body(p, task, w, d, DT_F16); break;
    }
}

static int take_tasks(void *arg) {
    Problem *p = arg;
    const size_t lanes = (size_t)p->stride, d = (size_t)p->head_dim;
    /* zeroed: a value tile may read weight lanes past the rows (their accumulator rows
     * are never written out), which are 0 or an earlier task's finite weights */
    float *buf = calloc(lanes * (2 * d + KC + 2) + lanes, sizeof(float));
    if (!buf) return KVLAB_ENOMEM;
    Scratch w = {buf, buf + lanes * d, buf + lanes * (d + KC), buf + lanes * (2 * d + KC),
                 buf + lanes * (2 * d + KC + 1), (int32_t *)(buf + lanes * (2 * d + KC + 2))};
    for (;;) {
        const int t = __atomic_fetch_add(&p->next_task, 1, __ATOMIC_RELAXED);
        if (t >= p->tasks) break;
        if (p->head_dim == 64) task_dim(p, t, &w, 64); /* unrolled for the common sizes */
        else if (p->head_dim == 128) task_dim(p, t, &w, 128);
        else task_dim(p, t, &w, p->head_dim);
    }
    free(buf);
    return KVLAB_OK;
}

/* ---- entry point --------------------------------------------------------------------- */

static int check_args(const Problem *p, int64_t num_slots) {
    if (p->heads < 1 || p->heads > MAX_HEADS || p->kv_heads < 1 || p->heads % p->kv_heads)
        return KVLAB_EARG;
    if (p->head_dim < V || p->head_dim > MAX_HEAD_DIM || p->head_dim % V) return KVLAB_EARG;
    if (!dtype_ok(p->dtype_q) || !dtype_ok(p->dtype_kv)) return KVLAB_EARG;
    if (!p->q || !p->k || !p->v || !p->out || !p->slots) return KVLAB_EARG;
    if (p->k_slot_stride < 0 || p->k_head_stride < 0) return KVLAB_EARG;
    if (p->v_slot_stride < 0 || p->v_head_stride < 0) return KVLAB_EARG;
    if (p->rows_q < 1 || p->positions < p->rows_q || p->positions > INT32_MAX - KC)
        return KVLAB_ELEN;
    for (int j = 0; j < p->positions; j++)
        if (p->slots[j] < 0 || p->slots[j] >= num_slots) return KVLAB_ESLOT;
    return KVLAB_OK;
}

/* q, out: (Q, heads, head_dim) contiguous, rows at positions S - Q .. S - 1; k, v:
 * (num_slots, kv_heads, head_dim) with the given element strides, last dim contiguous;
 * slots: (S,) contiguous. */
int kvlab_paged_prefill(const void *q, const void *k, const void *v, void *out, int dtype_q,
                        int dtype_kv, const int64_t *slots, int Q, int S, int64_t num_slots,
                        int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                        int64_t v_head_stride, int heads, int kv_heads, int head_dim,
                        float scale, int num_threads) {
    Problem p = {.q = q, .k = k, .v = v, .out = out, .dtype_q = dtype_q, .dtype_kv = dtype_kv,
                 .slots = slots, .k_slot_stride = k_slot_stride, .k_head_stride = k_head_stride,
                 .v_slot_stride = v_slot_stride, .v_head_stride = v_head_stride, .rows_q = Q,
                 .positions = S, .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim,
                 .group = kv_heads > 0 ? heads / kv_heads : 0, .scale = scale};
    int status = check_args(&p, num_slots);
    if (status != KVLAB_OK) return status;
    p.blocks = (Q + QB - 1) / QB;
    p.stride = ((QB * p.group + V - 1) / V * V + MR - 1) / MR * MR;
    p.tasks = p.blocks * kv_heads;
    p.next_task = 0;
    const int64_t pairs = (int64_t)Q * S * kv_heads;
    const int threads = pairs < MIN_PARALLEL ? 1 : num_threads < p.tasks ? num_threads : p.tasks;
    status = kvlab_run_parallel(threads, take_tasks, &p);
    return status;
}
