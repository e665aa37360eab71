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
#define TILE 512       /* bf16 elements in a 16 x 64-byte tile */

#if KVLAB_AMX_BUILT
#include <immintrin.h>
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

typedef struct { /* ldtilecfg's operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes. In static memory: GCC drops the stores that fill a local
 * configuration when ldtilecfg is the only instruction that reads it (seen in a small
 * function, whose ldtilecfg then read garbage and faulted). */
static const TileConfig TILES_16X64 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};
#endif

/* 1 when the CPU has AMX-BF16, AVX-512 and AVX512-BF16 and Linux lets this process use
 * the tile registers (asked once; the answer is kept). */
int kvlab_amx_ready(void);

#endif
