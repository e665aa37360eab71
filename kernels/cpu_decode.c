/* Paged decode attention on the CPU: K/V read in place from the KV pool through slots.
 *
 * Plain C, no torch headers: kernels/cpu_decode.py compiles it once per machine with
 *     cc -O3 -march=native -shared -fPIC -pthread
 * and calls kvlab_paged_decode through ctypes.
 *
 * One task is one (sequence b, kv head kvh): it serves the g = heads / kv_heads query
 * heads that share kvh, so each K row and each V row of the context is read once.
 *   1. scores s[r][j] = scale * q_r . k_j for the g query rows r and positions j < len,
 *      k_j being the row of slot slots[b][j] (positions >= len are never read);
 *   2. softmax of each score row in fp32: subtract its max, exp, sum;
 *   3. acc[r] = sum_j p[r][j] v_j in fp32, then out_r = acc[r] / sum[r] in q's dtype
 *      (bf16 rounds to nearest even).
 * Speed: decode is memory-bound, so the loops are shaped for gcc's vectoriser without
 * -ffast-math. Dot products accumulate into a fixed-size float array (LANES wide); the V
 * pass adds TILE rows into each accumulator element before storing it; K/V elements are
 * converted (bf16, fp16) as they are loaded, never copied; exp is a range-reduced
 * polynomial (~1 ulp), branch-free; rows PREFETCH_AHEAD positions ahead are prefetched
 * (slots are scattered, so the hardware prefetcher cannot guess them). head_dim 64, 96,
 * 128 and 256 get their own fully unrolled copies. The B * kv_heads tasks are split over
 * pthreads (not OpenMP: torch brings its own runtime) in contiguous ranges of about
 * equal context length.
 *
 * Dtypes: 0 float32, 1 bfloat16, 2 float16 (where the compiler has _Float16).
 * Returns 0, or a KVLAB_E* code.
 */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__FLT16_MAX__)
#define KVLAB_HAVE_F16 1
#else
#define KVLAB_HAVE_F16 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { KVLAB_OK = 0, KVLAB_EARG = 1, KVLAB_ELEN = 2, KVLAB_ESLOT = 3, KVLAB_ENOMEM = 4 };

#define LANES 16            /* width of the accumulator arrays (lane_sum assumes 16) */
#define MAX_HEAD_DIM 1024
#define MAX_HEADS 4096
#define MAX_THREADS 256
#define TASK_OVERHEAD 16    /* a task's fixed cost, in context positions, for the split */
#define MIN_PARALLEL 1024   /* below this many (position, kv head) pairs, run inline */
#define PREFETCH_AHEAD 8    /* positions ahead whose K/V rows are prefetched */
#define TILE 8              /* positions per step of the value pass */

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

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
} Problem;

typedef struct {
    const Problem *p;
    int first, last; /* task range [first, last) */
    int status;
} Chunk;

typedef struct {        /* one thread's scratch, all fp32 */
    float *q;           /* (group, head_dim) */
    float *acc;         /* (group, head_dim) */
    float *sums;        /* (group,) softmax denominators */
    float *scores;      /* (group, max_len) */
} Scratch;

/* ---- element conversion --------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static int dtype_ok(int dtype) {
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

/* base[offset + i] = x[i] * mul for i < n, rounded to `dtype` (nearest even) */
static ALWAYS_INLINE void store(void *base, int dtype, int64_t offset, const float *restrict x,
                                float mul, int n) {
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

/* ---- vector helpers: fixed-width lane arrays that gcc vectorises ------------------- */

/* The sum of the LANES (16) floats, as a fixed tree of adds (a loop over halving widths
 * keeps the lanes in memory). */
static ALWAYS_INLINE float lane_sum(const float *lane) {
    float half[8], quarter[4];
    for (int i = 0; i < 8; i++) half[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++) quarter[i] = half[i] + half[i + 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* q . row, row being d elements of `dtype` at base[offset] */
static ALWAYS_INLINE float dot(const float *restrict q, const void *base, int dtype,
                               int64_t offset, int d) {
    float lane[LANES] = {0};
    int c = 0;
    for (; c + LANES <= d; c += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += q[c + i] * load(base, dtype, offset + c + i);
    for (; c < d; c++) lane[0] += q[c] * load(base, dtype, offset + c);
    return lane_sum(lane);
}

static float max_of(const float *x, int n) {
    float lane[LANES], half[8], quarter[4];
    for (int i = 0; i < LANES; i++) lane[i] = x[0];
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int i = 0; i < LANES; i++) lane[i] = x[j + i] > lane[i] ? x[j + i] : lane[i];
    for (; j < n; j++) lane[0] = x[j] > lane[0] ? x[j] : lane[0];
    for (int i = 0; i < 8; i++) half[i] = lane[i + 8] > lane[i] ? lane[i + 8] : lane[i];
    for (int i = 0; i < 4; i++) quarter[i] = half[i + 4] > half[i] ? half[i + 4] : half[i];
    float a = quarter[0] > quarter[1] ? quarter[0] : quarter[1];
    float b = quarter[2] > quarter[3] ? quarter[2] : quarter[3];
    return a > b ? a : b;
}

/* e^x, ~1 ulp for x in [-87, 88] (Cephes expf): x = n ln2 + r, |r| <= ln2 / 2,
 * e^x = 2^n e^r with a degree-7 polynomial for e^r. Below -87 it returns e^-87
 * (~1.6e-38), never a denormal; NaN stays NaN. Branch-free, so loops over it vectorise. */
static inline float fast_exp(float x) {
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

/* x[j] <- e^(x[j] - max x); returns the sum. */
static float exp_shifted(float *x, int n) {
    float m = max_of(x, n);
    float lane[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int i = 0; i < LANES; i++) {
            x[j + i] = fast_exp(x[j + i] - m);
            lane[i] += x[j + i];
        }
    for (; j < n; j++) {
        x[j] = fast_exp(x[j] - m);
        lane[0] += x[j];
    }
    return lane_sum(lane);
}

/* ---- one task: sequence b, kv head kvh ------------------------------------------ */

/* The task's functions are inlined into run_task's cases, so head_dim and the cache
 * dtype are constants there: the loops over head_dim unroll and the dtype branches go.
 * K/V elements go from the cache straight into the arithmetic (no converted copy). */

static ALWAYS_INLINE void prefetch_row(const void *base, int dtype, int64_t offset, int d) {
#if defined(__GNUC__)
    const int64_t size = dtype == DT_F32 ? 4 : 2;
    const char *at = (const char *)base + offset * size;
    for (int64_t byte = 0; byte < d * size; byte += 64) __builtin_prefetch(at + byte);
#else
    (void)base, (void)dtype, (void)offset, (void)d;
#endif
}

/* scores[r][j] = scale * q_r . k_j for j < len */
static ALWAYS_INLINE void score_pass(const Problem *p, const int64_t *slots, int len, int kvh,
                                     Scratch *s, int d, int dtype) {
    const int g = p->group;
    const int64_t head = kvh * p->k_head_stride, stride = p->k_slot_stride;
    for (int j = 0; j < len; j++) {
        if (j + PREFETCH_AHEAD < len)
            prefetch_row(p->k, dtype, slots[j + PREFETCH_AHEAD] * stride + head, d);
        const int64_t row = slots[j] * stride + head;
        for (int r = 0; r < g; r++)
            s->scores[(int64_t)r * len + j] = p->scale * dot(s->q + r * d, p->k, dtype, row, d);
    }
}

/* acc += sum_t weight[t] v_t over n <= TILE rows at base[rows[t]]; a full TILE loads
 * and stores acc once. */
static ALWAYS_INLINE void accumulate(float *restrict acc, const float *restrict weight,
                                     const void *base, int dtype, const int64_t *rows, int n,
                                     int d) {
    if (n < TILE) {
        for (int t = 0; t < n; t++)
            for (int c = 0; c < d; c++) acc[c] += weight[t] * load(base, dtype, rows[t] + c);
        return;
    }
    for (int c = 0; c < d; c++) {
        float x = acc[c];
        for (int t = 0; t < TILE; t++) x += weight[t] * load(base, dtype, rows[t] + c);
        acc[c] = x;
    }
}

/* acc[r] = sum_j scores[r][j] v_j, TILE positions at a time */
static ALWAYS_INLINE void value_pass(const Problem *p, const int64_t *slots, int len, int kvh,
                                     Scratch *s, int d, int dtype) {
    const int g = p->group;
    const int64_t head = kvh * p->v_head_stride, stride = p->v_slot_stride;
    memset(s->acc, 0, sizeof(float) * (size_t)g * (size_t)d);
    for (int j = 0; j < len; j += TILE) {
        const int n = len - j < TILE ? len - j : TILE;
        int64_t rows[TILE];
        for (int t = 0; t < n; t++) {
            if (j + t + PREFETCH_AHEAD < len)
                prefetch_row(p->v, dtype, slots[j + t + PREFETCH_AHEAD] * stride + head, d);
            rows[t] = slots[j + t] * stride + head;
        }
        for (int r = 0; r < g; r++)
            accumulate(s->acc + r * d, s->scores + (int64_t)r * len + j, p->v, dtype, rows, n, d);
    }
}

static ALWAYS_INLINE void task_body(const Problem *p, int task, Scratch *s, int d, int dtype) {
    const int b = task / p->kv_heads, kvh = task % p->kv_heads;
    const int g = p->group, len = (int)p->lens[b];
    const int64_t *slots = p->slots + (int64_t)b * p->slots_stride;
    const int64_t q_row = ((int64_t)b * p->heads + (int64_t)kvh * g) * d; /* first of g rows */
    for (int i = 0; i < g * d; i++) s->q[i] = load(p->q, p->dtype_q, q_row + i);
    score_pass(p, slots, len, kvh, s, d, dtype);
    for (int r = 0; r < g; r++) s->sums[r] = exp_shifted(s->scores + (int64_t)r * len, len);
    value_pass(p, slots, len, kvh, s, d, dtype);
    for (int r = 0; r < g; r++)
        store(p->out, p->dtype_q, q_row + (int64_t)r * d, s->acc + r * d, 1.0f / s->sums[r], d);
}

static ALWAYS_INLINE void task_dim(const Problem *p, int task, Scratch *s, int d) {
    switch (p->dtype_kv) {
    case DT_F32: task_body(p, task, s, d, DT_F32); break;
    case DT_BF16: task_body(p, task, s, d, DT_BF16); break;
    default: task_body(p, task, s, d, DT_F16); break;
    }
}

static void run_task(const Problem *p, int task, Scratch *s) {
    switch (p->head_dim) { /* the common head sizes get their own unrolled copies */
    case 64: task_dim(p, task, s, 64); break;
    case 96: task_dim(p, task, s, 96); break;
    case 128: task_dim(p, task, s, 128); break;
    case 256: task_dim(p, task, s, 256); break;
    default: task_dim(p, task, s, p->head_dim); break;
    }
}

/* ---- threads ---------------------------------------------------------------------- */

static void *run_chunk(void *arg) {
    Chunk *c = (Chunk *)arg;
    const Problem *p = c->p;
    const size_t g = (size_t)p->group, d = (size_t)p->head_dim, gd = g * d;
    float *buf = malloc(sizeof(float) * (2 * gd + g + g * (size_t)p->max_len));
    if (!buf) {
        c->status = KVLAB_ENOMEM;
        return NULL;
    }
    Scratch s = {buf, buf + gd, buf + 2 * gd, buf + 2 * gd + g};
    for (int t = c->first; t < c->last; t++) run_task(p, t, &s);
    free(buf);
    c->status = KVLAB_OK;
    return NULL;
}

/* bounds[0..n]: n contiguous task ranges of about equal context length */
static void split_tasks(const Problem *p, int n, int *bounds) {
    const int tasks = p->batch * p->kv_heads;
    int64_t total = 0, seen = 0;
    for (int b = 0; b < p->batch; b++) total += (p->lens[b] + TASK_OVERHEAD) * p->kv_heads;
    int t = 1;
    bounds[0] = 0;
    for (int i = 0; i < tasks && t < n; i++) {
        seen += p->lens[i / p->kv_heads] + TASK_OVERHEAD;
        while (t < n && seen * n >= total * t) bounds[t++] = i + 1;
    }
    while (t <= n) bounds[t++] = tasks;
}

static int thread_count(const Problem *p, int wanted) {
    const int tasks = p->batch * p->kv_heads;
    int64_t work = 0;
    for (int b = 0; b < p->batch; b++) work += p->lens[b] * p->kv_heads;
    int n = wanted < tasks ? wanted : tasks;
    n = n < MAX_THREADS ? n : MAX_THREADS;
    return work < MIN_PARALLEL || n < 1 ? 1 : n;
}

static int run_all(const Problem *p, int num_threads) {
    const int n = thread_count(p, num_threads);
    int bounds[MAX_THREADS + 1];
    Chunk chunks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    split_tasks(p, n, bounds);
    for (int t = 0; t < n; t++) chunks[t] = (Chunk){p, bounds[t], bounds[t + 1], KVLAB_OK};
    for (int t = 1; t < n; t++)
        started[t] = pthread_create(&ids[t], NULL, run_chunk, &chunks[t]) == 0;
    run_chunk(&chunks[0]);
    int status = chunks[0].status;
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_chunk(&chunks[t]); /* no thread: run its share here */
        status = status ? status : chunks[t].status;
    }
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

/* q, out: (B, heads, head_dim) contiguous; k, v: (num_slots, kv_heads, head_dim) with
 * the given element strides, last dim contiguous; slots: (B, max_len) with row stride
 * slots_stride; lens: (B,) each in [1, max_len]. */
int kvlab_paged_decode(const void *q, const void *k, const void *v, void *out, int dtype_q,
                       int dtype_kv, const int64_t *slots, int64_t slots_stride,
                       const int64_t *lens, int64_t max_len, int64_t num_slots,
                       int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                       int64_t v_head_stride, int B, int heads, int kv_heads, int head_dim,
                       float scale, int num_threads) {
    Problem p = {q, k, v, out, dtype_q, dtype_kv, slots, slots_stride, lens, max_len,
                 k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                 B, heads, kv_heads, head_dim, kv_heads > 0 ? heads / kv_heads : 0, scale};
    int status = check_args(&p, num_slots);
    if (status != KVLAB_OK || B == 0) return status;
    return run_all(&p, num_threads);
}
