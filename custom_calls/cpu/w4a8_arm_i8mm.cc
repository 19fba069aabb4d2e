// Armv8.6 i8mm (smmla) tile for the kArm8 layout: [2 x 8] x [8 x 2] -> [2 x 2]
// int32 per instruction, activations as row pairs (TileArgs::xpairs).
// A 32-byte chunk holds 8 columns x 8 k in four smmla operands: the high then the
// low nibbles of bytes 0..15 are columns (0,1) and (2,3), of bytes 16..31
// columns (4,5) and (6,7) (the paper's ushr/and unpacking).
// Compiled with -march=armv8.2-a+dotprod+i8mm.
#include <arm_neon.h>

#include "w4a8.h"

namespace lrjax_w4a8 {
namespace {

// Rows [m0, m0 + 2 MP) x NB blocks of 8 columns; rows >= m0 + mr are not stored.
template <int MP, int NB>
void Tile(const TileArgs& a, int64_t m0, int mr, int64_t n0, float* acc) {
  const uint8x16_t mask = vdupq_n_u8(0x0f);
  const uint8_t* wp = a.packed + (n0 / 8) * (a.Kp * 4);
  const int64_t wstride = a.Kp * 4;
  const int8_t* xp[MP];
  for (int p = 0; p < MP; ++p) xp[p] = a.xpairs + (m0 / 2 + p) * (a.Kp / 8) * 16;
  float32x4_t facc[MP][NB][4];  // lanes: (r0 c0, r0 c1, r1 c0, r1 c1)
  for (int p = 0; p < MP; ++p)
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < 4; ++j) facc[p][b][j] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t k0 = g * a.group;
    const int64_t k1 = k0 + a.group < a.Kp ? k0 + a.group : a.Kp;
    int32x4_t ia[MP][NB][4];
    for (int p = 0; p < MP; ++p) {
      const int32_t* init = a.xinit + (m0 + 2 * p) * a.G + g;
      const int32x4_t i0 = vcombine_s32(vdup_n_s32(init[0]), vdup_n_s32(init[a.G]));
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < 4; ++j) ia[p][b][j] = i0;
    }
    for (int64_t k = k0; k < k1; k += 8) {
      const int64_t kc = k / 8;
      int8x16_t w[NB][4];
      for (int b = 0; b < NB; ++b) {
        const uint8x16_t w0 = vld1q_u8(wp + b * wstride + kc * 32);
        const uint8x16_t w1 = vld1q_u8(wp + b * wstride + kc * 32 + 16);
        w[b][0] = vreinterpretq_s8_u8(vshrq_n_u8(w0, 4));
        w[b][1] = vreinterpretq_s8_u8(vandq_u8(w0, mask));
        w[b][2] = vreinterpretq_s8_u8(vshrq_n_u8(w1, 4));
        w[b][3] = vreinterpretq_s8_u8(vandq_u8(w1, mask));
      }
      for (int p = 0; p < MP; ++p) {
        const int8x16_t x = vld1q_s8(xp[p] + kc * 16);
        for (int b = 0; b < NB; ++b)
          for (int j = 0; j < 4; ++j) ia[p][b][j] = vmmlaq_s32(ia[p][b][j], x, w[b][j]);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < 4; ++j) {
        const float32x2_t s2 = vld1_f32(a.scales + g * a.Np + n0 + 8 * b + 2 * j);
        const float32x4_t s = vcombine_f32(s2, s2);
        for (int p = 0; p < MP; ++p)
          facc[p][b][j] = vaddq_f32(facc[p][b][j], vmulq_f32(vcvtq_f32_s32(ia[p][b][j]), s));
      }
  }
  for (int p = 0; p < MP; ++p)
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < 4; ++j) {
        float* row0 = acc + (2 * p) * kTileN + 8 * b + 2 * j;
        vst1_f32(row0, vget_low_f32(facc[p][b][j]));
        if (2 * p + 1 < mr) vst1_f32(row0 + kTileN, vget_high_f32(facc[p][b][j]));
      }
}

template <int MP>
void TileM(const TileArgs& a, int64_t m0, int mr, int64_t n0, int nb, float* acc) {
  if (nb == 1) return Tile<MP, 1>(a, m0, mr, n0, acc);
  return Tile<MP, 2>(a, m0, mr, n0, acc);
}

}  // namespace

void TileArm8I8mm(const TileArgs& a, int64_t m0, int mr, int64_t n0, int nc, float* acc) {
  const int nb = nc / 8;
  if (mr <= 2) return TileM<1>(a, m0, mr, n0, nb, acc);
  return TileM<2>(a, m0, mr, n0, nb, acc);
}

}  // namespace lrjax_w4a8
