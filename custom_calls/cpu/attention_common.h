// What the CPU attention kernels share (decode_attention.cc, attention.cc and the bodies they
// include): a portable dot product, and when a call is worth the thread pool. Everything here
// is static inline: each ISA's file compiles its own copy.
#pragma once
#include <cstdint>

namespace lrjax_cpu {

// x·y in eight interleaved partial sums (vectorizable without -ffast-math), then the tail
static inline float Dot8(const float* x, const float* y, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[d + j] * y[d + j];
  float s = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += x[d] * y[d];
  return s;
}

// Below this many bytes of K and V a call (about 30 us on one thread), the calling thread
// works alone: waking the pool's threads, and taking cores that XLA's own threads are about to
// use, cost as much as they save.
constexpr int64_t kAttnParallelBytes = 1 << 20;

}  // namespace lrjax_cpu
