// AVX2 tile for the kX86 layout: vpmaddubsw (u4 x s8 pairs; |sum| <= 2*15*127,
// never saturates) then vpmaddwd by ones to int32 lanes of 4 k, as vpdpbusd.
// Compiled with -mavx2 -mfma.
#include <immintrin.h>

#include "w4a8.h"

#define LRJAX_DOT_NEEDS_ONES
#define LRJAX_DOT(acc, w, x) \
  (acc) = _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), ones))
#define LRJAX_TILE_NAME TileX86Avx2
#include "w4a8_x86_ymm.inc"
