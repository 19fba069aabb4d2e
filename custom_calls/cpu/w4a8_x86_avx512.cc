// AVX512-VNNI tile for the kX86 layout: vpdpbusd with the uint4 weights as the
// unsigned operand (one 64-byte load holds 16 columns x 8 k as two nibble
// planes) and 4 activation bytes broadcast as the signed operand.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni; internal linkage
// only, so no inline function compiled here leaks to other translation units.
#include <immintrin.h>

#include "w4a8.h"

namespace lrjax_w4a8 {
namespace {

inline int32_t Load4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Rows [m0, m0+MR) x NV blocks of 16 columns. Small tiles (decode) keep separate
// accumulators for the low and high nibble planes to halve the dependency chain.
template <int MR, int NV>
void Tile(const TileArgs& a, int64_t m0, int64_t n0, float* acc) {
  constexpr bool kSplit = MR * NV <= 4;
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const uint8_t* wp = a.packed + (n0 / 16) * (a.Kp * 8);
  const int64_t wstride = a.Kp * 8;
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = a.xq + (m0 + r) * a.Kp;
  __m512 facc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) facc[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t k0 = g * a.group;
    const int64_t k1 = k0 + a.group < a.Kp ? k0 + a.group : a.Kp;
    __m512i ia[MR][NV], ib[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        ia[r][v] = _mm512_set1_epi32(a.xinit[(m0 + r) * a.G + g]);
        ib[r][v] = _mm512_setzero_si512();
      }
    for (int64_t k = k0; k < k1; k += 8) {
      __m512i lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        const __m512i w = _mm512_loadu_si512(wp + v * wstride + k * 8);
        lo[v] = _mm512_and_si512(w, mask);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i x0 = _mm512_set1_epi32(Load4(xr[r] + k));
        const __m512i x1 = _mm512_set1_epi32(Load4(xr[r] + k + 4));
        for (int v = 0; v < NV; ++v) {
          ia[r][v] = _mm512_dpbusd_epi32(ia[r][v], lo[v], x0);
          if (kSplit)
            ib[r][v] = _mm512_dpbusd_epi32(ib[r][v], hi[v], x1);
          else
            ia[r][v] = _mm512_dpbusd_epi32(ia[r][v], hi[v], x1);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const __m512 s = _mm512_loadu_ps(a.scales + g * a.Np + n0 + 16 * v);
      for (int r = 0; r < MR; ++r) {
        const __m512i i = kSplit ? _mm512_add_epi32(ia[r][v], ib[r][v]) : ia[r][v];
        facc[r][v] = _mm512_add_ps(facc[r][v], _mm512_mul_ps(_mm512_cvtepi32_ps(i), s));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + r * kTileN + 16 * v, facc[r][v]);
}

template <int MR>
void TileM(const TileArgs& a, int64_t m0, int64_t n0, int nv, float* acc) {
  switch (nv) {
    case 1: return Tile<MR, 1>(a, m0, n0, acc);
    case 2: return Tile<MR, 2>(a, m0, n0, acc);
    case 3: return Tile<MR, 3>(a, m0, n0, acc);
    default: return Tile<MR, 4>(a, m0, n0, acc);
  }
}

}  // namespace

void TileX86Avx512Vnni(const TileArgs& a, int64_t m0, int mr, int64_t n0, int nc, float* acc) {
  const int nv = nc / 16;
  switch (mr) {
    case 1: return TileM<1>(a, m0, n0, nv, acc);
    case 2: return TileM<2>(a, m0, n0, nv, acc);
    case 3: return TileM<3>(a, m0, n0, nv, acc);
    case 4: return TileM<4>(a, m0, n0, nv, acc);
    case 5: return TileM<5>(a, m0, n0, nv, acc);
    default: return TileM<6>(a, m0, n0, nv, acc);
  }
}

}  // namespace lrjax_w4a8
