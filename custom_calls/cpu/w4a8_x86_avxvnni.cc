// AVX-VNNI (VEX vpdpbusd on ymm) tile for the kX86 layout.
// Compiled with -mavx2 -mfma -mavxvnni.
#include <immintrin.h>

#include "w4a8.h"

#define LRJAX_DOT(acc, w, x) (acc) = _mm256_dpbusd_avx_epi32((acc), (w), (x))
#define LRJAX_TILE_NAME TileX86AvxVnni
#include "w4a8_x86_ymm.inc"
