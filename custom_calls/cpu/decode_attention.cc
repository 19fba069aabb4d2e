// Decode attention over the KV cache (decode_attention.h). Per (row, KV head), one task on the
// W4A8 kernels' pool: the G query heads' scores over the visible keys, each key row read once
// for all G; the softmax as jax.nn.softmax computes it (scores / sqrt(D), exp(s - max), divided
// by their sum); then p·V, each value row read once for all G. This file holds the portable
// body and the dispatch; decode_attention_x86_avx2.cc the AVX2 + FMA body.
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_common.h"
#include "w4a8.h"

namespace lrjax_cpu {

namespace {

bool Avx2Serves(int64_t D) {
#if defined(LRJAX_W4A8_X86)
  return D % 8 == 0 && lrjax_w4a8::IsaAllowed(lrjax_w4a8::Isa::kAvx2);
#else
  (void)D;
  return false;
#endif
}

}  // namespace

void AttendHeadScalar(const AttendArgs& a, int64_t b, int64_t h, float* scratch) {
  const Head x = HeadOf(a, b, h, scratch);
  const int64_t G = x.G, D = a.D, n = x.n;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g)
      x.scores[g * n + t] = x.none ? 0.f : Dot8(x.q + g * D, x.k + t * D, D) / a.root;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = x.scores + g * n;
    const float m = *std::max_element(sg, sg + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (sg[t] = std::exp(sg[t] - m));
    for (int64_t t = 0; t < n; ++t) sg[t] /= sum;
  }
  std::fill(x.acc, x.acc + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = x.v + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = x.scores[g * n + t];
      float* ag = x.acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += w * vt[d];
    }
  }
  std::copy(x.acc, x.acc + G * D, x.out);
}

const char* DecodeAttentionIsa(int64_t D) { return Avx2Serves(D) ? "avx2" : "scalar"; }

void DecodeAttentionF32(const float* q, const float* k, const float* v, const int32_t* pos,
                        float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D,
                        int64_t length, int64_t window) {
  const AttendArgs a{q, k, v, pos, out, Hq, Hkv, T, D, length, window,
                     std::sqrt(static_cast<float>(D))};
  auto body = AttendHeadScalar;
#if defined(LRJAX_W4A8_X86)
  if (Avx2Serves(D)) body = AttendHeadAvx2;
#endif
  const auto task = [&](int64_t i) {
    thread_local std::vector<float> scratch;  // per thread, reused
    scratch.resize(static_cast<size_t>(ScratchFloats(a)));
    body(a, i / Hkv, i % Hkv, scratch.data());
  };
  const int64_t tasks = B * Hkv;
  if (2 * B * Hkv * length * D * 4 < kAttnParallelBytes) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
  } else {
    lrjax_w4a8::ParallelFor(tasks, task);
  }
}

}  // namespace lrjax_cpu
