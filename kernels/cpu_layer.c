/* A decoder layer's decode step around attention in two native calls, where the runner
 * made about ten (each a ctypes call, a Python wrapper and a new tensor), in bf16 or fp32:
 *
 *   kvlab_layer_qkv   h += delta; x = rms_norm(h); qkv = x Wqkv^T (+ b); RoPE on Q's and
 *                     K's heads of qkv, in place
 *   kvlab_layer_mlp   o = attn Wo^T; h += o; x = rms_norm(h); gu = x Wgate_up^T;
 *                     mlp = (silu(gate) * up) Wdown^T
 *
 * Each step is the entry point the runner calls one by one otherwise (kvlab_add_rms_norm,
 * kvlab_rope, kvlab_silu_mul, and for the matmuls kvlab_linear_amx in bf16 on AMX or the
 * stream, kvlab_stream_linear or kvlab_stream_linear_bf16), in the same order on the same
 * values, so the bits are the per-op path's. The matmuls' wall time adds up in a counter
 * that `kvlab profile` reads (kvlab_layer_matmul_ns), so a step's matmuls are still shown
 * apart. Up to 32 rows (the linears' limit); the weights packed by kvlab_linear_pack (bf16
 * on AMX, `stream` 0) or kvlab_stream_pack(_bf16) (`stream` 1). Every tensor is of `dtype`
 * (DT_BF16 or DT_F32).
 */

#include <stdatomic.h>
#include <time.h>

#include "cpu_amx.h"
#include "cpu_common.h"

static _Atomic uint64_t matmul_ns; /* wall time inside this file's matmuls, ever */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* x W^T (+ bias) into contiguous rows, its time counted: the stream in `dtype` where
 * `stream` is 1, else kvlab_linear_amx (bf16). */
static int linear(const void *x, int64_t x_stride, int rows, const void *w, const void *bias,
                  void *out, int64_t n, int64_t k, int threads, int dtype, int stream) {
    const uint64_t start = now_ns();
    const int status =
        dtype == DT_F32 && stream
            ? kvlab_stream_linear(x, x_stride, rows, w, bias, out, n, n, k, threads)
        : dtype == DT_BF16 && stream
            ? kvlab_stream_linear_bf16(x, x_stride, rows, w, bias, out, n, n, k, threads)
        : dtype == DT_BF16 ? kvlab_linear_amx(x, x_stride, rows, w, bias, out, n, n, k, threads)
                           : KVLAB_EARG;
    atomic_fetch_add_explicit(&matmul_ns, now_ns() - start, memory_order_relaxed);
    return status;
}

static size_t size_of(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* *total = nanoseconds spent in the layer calls' matmuls since the library loaded. */
int kvlab_layer_matmul_ns(uint64_t *total) {
    if (!total) return KVLAB_EARG;
    *total = atomic_load_explicit(&matmul_ns, memory_order_relaxed);
    return KVLAB_OK;
}

/* h (rows, hidden) contiguous, updated in place; delta (rows, hidden) contiguous or NULL;
 * norm (hidden,); qkv_w packed (N = (heads + 2 kv_heads) head_dim, K = hidden); qkv_b (N,)
 * or NULL; cos, sin (rows, head_dim) with row stride cs_stride; qkv (rows, N) contiguous,
 * the output: Q's and K's heads rotated, V's as the matmul left them. */
int kvlab_layer_qkv(void *h, const void *delta, const void *norm, float eps,
                    const void *qkv_w, const void *qkv_b, const void *cos, const void *sin,
                    int64_t cs_stride, void *qkv, int rows, int hidden, int heads,
                    int kv_heads, int head_dim, int threads, int dtype, int stream) {
    if (!h || !qkv || rows < 1 || hidden < 1 || heads < 1 || kv_heads < 1) return KVLAB_EARG;
    if (dtype != DT_BF16 && dtype != DT_F32) return KVLAB_EARG;
    const int64_t n = (int64_t)(heads + 2 * kv_heads) * head_dim;
    void *x = malloc((size_t)rows * hidden * size_of(dtype));
    if (!x) return KVLAB_ENOMEM;
    int status = kvlab_add_rms_norm(h, hidden, delta, hidden, norm, x, hidden, rows, hidden,
                                    eps, threads, dtype);
    if (status == KVLAB_OK)
        status = linear(x, hidden, rows, qkv_w, qkv_b, qkv, n, hidden, threads, dtype, stream);
    if (status == KVLAB_OK)
        status = kvlab_rope(qkv, n, cos, sin, cs_stride, qkv, n, rows, heads + kv_heads,
                            head_dim, threads, dtype);
    free(x);
    return status;
}

/* h (rows, hidden) contiguous, updated in place; attn (rows, q_dim) with row stride
 * attn_stride; o_w packed (hidden, q_dim); norm (hidden,); gate_up_w packed (2 inter,
 * hidden); down_w packed (hidden, inter); mlp (rows, hidden) contiguous, the output. */
int kvlab_layer_mlp(void *h, const void *attn, int64_t attn_stride, const void *o_w,
                    const void *norm, float eps, const void *gate_up_w, const void *down_w,
                    void *mlp, int rows, int hidden, int q_dim, int inter, int threads,
                    int dtype, int stream) {
    if (!h || !attn || !mlp || rows < 1 || hidden < 1 || q_dim < 1 || inter < 1)
        return KVLAB_EARG;
    if (dtype != DT_BF16 && dtype != DT_F32) return KVLAB_EARG;
    const size_t r = (size_t)rows, size = size_of(dtype);
    char *o = malloc(r * (2 * (size_t)hidden + 3 * (size_t)inter) * size);
    if (!o) return KVLAB_ENOMEM;
    char *x = o + r * hidden * size, *gate_up = x + r * hidden * size;
    char *act = gate_up + r * 2 * inter * size;
    int status =
        linear(attn, attn_stride, rows, o_w, NULL, o, hidden, q_dim, threads, dtype, stream);
    if (status == KVLAB_OK)
        status = kvlab_add_rms_norm(h, hidden, o, hidden, norm, x, hidden, rows, hidden, eps,
                                    threads, dtype);
    if (status == KVLAB_OK)
        status = linear(x, hidden, rows, gate_up_w, NULL, gate_up, 2 * (int64_t)inter, hidden,
                        threads, dtype, stream);
    if (status == KVLAB_OK)
        status = kvlab_silu_mul(gate_up, 2 * (int64_t)inter, gate_up + inter * size,
                                2 * (int64_t)inter, act, inter, rows, inter, threads, dtype);
    if (status == KVLAB_OK)
        status = linear(act, inter, rows, down_w, NULL, mlp, hidden, inter, threads, dtype,
                        stream);
    free(o);
    return status;
}
