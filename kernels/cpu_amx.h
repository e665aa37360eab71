/* What the AMX kernels share (cpu_amx.c: bf16 prompt attention; cpu_linear.c: a decode
 * step's bf16 linears): whether this build knows the instructions, the target attribute
 * that lets a function use them whatever -march says, the tile configuration, and
 * kvlab_amx_ready(), which says whether this CPU and kernel run them. */

#ifndef KVLAB_CPU_AMX_H
#define KVLAB_CPU_AMX_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__) &&                                            \
    ((defined(__clang__) && __clang_major__ >= 12) ||                                       \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KVLAB_AMX_BUILT 1
#else
#define KVLAB_AMX_BUILT 0
#endif

#define KVLAB_ENOAMX 5 /* this CPU, kernel or build has no AMX-BF16 */
#define TILE_BF16 512       /* bf16 elements in a 16 x 64-byte tile */

#if KVLAB_AMX_BUILT
#include <immintrin.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

typedef struct { /* ldtilecfg's operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes. In static memory: GCC drops the stores that fill a local
 * configuration when ldtilecfg is the only instruction that reads it. */
static const TileConfig TILES_16X64 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* 2^t for t <= 0 (a scaled score minus its row's max, in base 2) to about 3e-6 relative,
 * enough for a weight rounded to bf16 (2^-9): 2^t = 2^n 2^f with n = round(t), |f| <= 1/2,
 * a degree-4 polynomial for 2^f (fitted for the least relative error) and vscalefps for
 * 2^n, which gives 0 for the weights of masked lanes (keep) and below 2^-149. */
AMX static inline __m512 exp2_weight(__mmask16 keep, __m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.5700949182e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917859772e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024745001e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312181484e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999926139e-1f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* One task of decode attention on tiles (cpu_decode_amx.c, called by cpu_decode.c): the
 * kv_heads * gm query rows (kv head h's gm rows from row h * gm on) over n <= chunk
 * positions, their K/V records at slots[0 .. n). Out: each row's unnormalized acc, its
 * max (scaled scores) and its sum of weights. */
typedef struct {
    const uint16_t *q;     /* (kv_heads * gm, d) bf16 */
    const uint16_t *k, *v; /* the pool: (num_slots, kv_heads, d) bf16 with these strides */
    const int64_t *slots;  /* (n,) */
    int n, chunk, kv_heads, gm, d; /* chunk: a multiple of 16; d: of 32, at most 256 */
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    float scale;           /* > 0 */
    float *acc, *maxes, *sums; /* (kv_heads * gm, d), (kv_heads * gm,), likewise */
} DecodeChunk;

size_t kvlab_decode_amx_bytes(int chunk, int kv_heads, int gm, int d); /* scratch a thread */
void kvlab_decode_amx_begin(void); /* a thread's tile configuration, before its tasks */
void kvlab_decode_amx(const DecodeChunk *c, void *scratch);
void kvlab_decode_amx_end(void);   /* after them */
#endif

/* 1 when the CPU has AMX-BF16, AVX-512 and AVX512-BF16 and Linux lets this process use
 * the tile registers (asked once; the answer is kept). */
int kvlab_amx_ready(void);

#endif
