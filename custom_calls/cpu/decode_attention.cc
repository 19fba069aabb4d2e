// Decode attention over the KV cache (decode_attention.h). Per (row, KV head): the G query
// heads' scores over the visible keys, each key row read once for all G; the softmax as
// jax.nn.softmax computes it (scores / sqrt(D), exp(s - max), divided by their sum); then
// p·V, each value row read once for all G. The scratch is per thread and reused.
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace lrjax_cpu {

namespace {

// x·y in eight interleaved partial sums (vectorizable without -ffast-math), then the tail
float Dot(const float* x, const float* y, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[d + j] * y[d + j];
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += x[d] * y[d];
  return s;
}

}  // namespace

void DecodeAttentionF32(const float* q, const float* k, const float* v, const int32_t* pos,
                        float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D,
                        int64_t length, int64_t window) {
  const int64_t G = Hq / Hkv;
  const float root = std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> scores, acc;
  scores.resize(static_cast<size_t>(G * length));
  acc.resize(static_cast<size_t>(G * D));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = pos[b];
    int64_t first = 0, end = std::min<int64_t>(p + 1, length);
    if (window > 0) first = std::max<int64_t>(p - window + 1, 0);
    const bool none = end <= first;  // all masked: a uniform softmax over [0, length)
    if (none) first = 0, end = length;
    const int64_t n = end - first;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* kh = k + ((b * Hkv + h) * T + first) * D;
      const float* vh = v + ((b * Hkv + h) * T + first) * D;
      const float* qh = q + (b * Hq + h * G) * D;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kh + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          scores[g * n + t] = none ? 0.f : Dot(qg, kt, D) / root;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += (sg[t] = std::exp(sg[t] - m));
        for (int64_t t = 0; t < n; ++t) sg[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = vh + t * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += w * vt[d];
        }
      }
      std::copy(acc.begin(), acc.end(), out + (b * Hq + h * G) * D);
    }
  }
}

}  // namespace lrjax_cpu
