// Decode attention over a dense KV cache on the CPU: one new query a row against the
// cache buffer in place, the keys past a row's position (and past `length`) never read.
// The reference is lowering/decode_attention.py's (the models' einsum/softmax); this
// kernel computes it in f32, one task per (row, KV head) on the W4A8 kernels' thread pool.
#pragma once
#include <cstdint>

namespace lrjax_cpu {

// q [B, Hq, D], k/v [B, Hkv, T, D], pos [B] -> out [B, Hq * D]; query head j attends with
// KV head j / (Hq / Hkv). Key t is visible to row b iff t <= pos[b], t < length and, with a
// window > 0, pos[b] - t < window. A row with no visible key gets the reference's answer for
// an all-masked softmax: the mean of v over the first `length` keys.
void DecodeAttentionF32(const float* q, const float* k, const float* v, const int32_t* pos,
                        float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D,
                        int64_t length, int64_t window);

// The body that serves head dim D on this CPU: "avx2" (x86 with AVX2 and FMA, D a multiple
// of 8, unless LRJAX_W4A8_ISA=scalar) or "scalar" (portable C++ the compiler vectorizes).
const char* DecodeAttentionIsa(int64_t D);

// --- internal: one (row, KV head) per call, one body per ISA --------------------------------
struct AttendArgs {
  const float *q, *k, *v;
  const int32_t* pos;
  float* out;
  int64_t Hq, Hkv, T, D, length, window;
  float root;  // sqrt(D)
};
// One (row b, KV head h)'s view: its G query heads, its visible keys [first, first + n) as
// key and value rows, and its scratch (G scores per key, then G * D accumulators). none: no key
// is visible, and [0, length) is attended with all scores 0 (a uniform softmax). static: each
// ISA's file compiles its own copy.
struct Head {
  int64_t G, n;
  bool none;
  const float *q, *k, *v;  // [G, D], [n, D], [n, D]
  float *scores, *acc, *out;  // [G, n], [G, D], [G, D]
};
static inline Head HeadOf(const AttendArgs& a, int64_t b, int64_t h, float* scratch) {
  Head x;
  x.G = a.Hq / a.Hkv;
  const int64_t p = a.pos[b];
  int64_t first = 0, end = p + 1 < a.length ? p + 1 : a.length;
  if (a.window > 0 && p - a.window + 1 > 0) first = p - a.window + 1;
  x.none = end <= first;
  if (x.none) first = 0, end = a.length;
  x.n = end - first;
  x.q = a.q + (b * a.Hq + h * x.G) * a.D;
  x.k = a.k + ((b * a.Hkv + h) * a.T + first) * a.D;
  x.v = a.v + ((b * a.Hkv + h) * a.T + first) * a.D;
  x.scores = scratch;
  x.acc = scratch + x.G * x.n;
  x.out = a.out + (b * a.Hq + h * x.G) * a.D;
  return x;
}
// Floats of scratch a call needs: G scores per attended key, then G * D accumulators.
static inline int64_t ScratchFloats(const AttendArgs& a) {
  return a.Hq / a.Hkv * (a.length + a.D);
}
void AttendHeadScalar(const AttendArgs& a, int64_t b, int64_t h, float* scratch);
// x86 builds only; D % 8 == 0 (decode_attention_x86_avx2.cc)
void AttendHeadAvx2(const AttendArgs& a, int64_t b, int64_t h, float* scratch);

}  // namespace lrjax_cpu
