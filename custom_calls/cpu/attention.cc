// Prefill attention on the CPU (attention.h): the dispatch between the body compiled with the
// baseline flags (here) and with AVX2 + FMA (attention_x86_avx2.cc), and one task per (row,
// KV head, block of 8 queries) on the W4A8 kernels' thread pool.
#include "attention.h"

#include <cmath>
#include <vector>

#include "attention_common.h"
#include "w4a8.h"

#define LRJAX_ATTN_BLOCK AttendBlockScalar
#include "attention_block.inc"

namespace lrjax_cpu {

namespace {

bool UseAvx2() {
#if defined(LRJAX_W4A8_X86)
  return lrjax_w4a8::IsaAllowed(lrjax_w4a8::Isa::kAvx2);
#else
  return false;
#endif
}

}  // namespace

const char* AttentionIsa() { return UseAvx2() ? "avx2" : "scalar"; }

void AttentionF32(const float* q, const float* k, const float* v, const uint8_t* mask,
                  float* out, int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t T,
                  int64_t D, bool heads_first) {
  AttnArgs a{q, k, v, mask, out, S, Hq, Hkv, T, D, 0, 0, 0, std::sqrt(static_cast<float>(D))};
  a.kb = Hkv * T * D;
  a.kh = heads_first ? T * D : D;
  a.kt = heads_first ? D : Hkv * D;
  auto body = AttendBlockScalar;
#if defined(LRJAX_W4A8_X86)
  if (UseAvx2()) body = AttendBlockAvx2;
#endif
  const int64_t blocks = (S + kAttnQueryBlock - 1) / kAttnQueryBlock;
  const auto task = [&](int64_t i) {
    thread_local std::vector<float> scratch;  // per thread, reused
    scratch.resize(static_cast<size_t>(AttnScratchFloats(a)));
    body(a, i / (Hkv * blocks), i / blocks % Hkv, i % blocks * kAttnQueryBlock, scratch.data());
  };
  const int64_t tasks = B * Hkv * blocks;
  if (2 * B * Hkv * T * D * 4 < kAttnParallelBytes) {  // e.g. one decode step's attention
    for (int64_t i = 0; i < tasks; ++i) task(i);
  } else {
    lrjax_w4a8::ParallelFor(tasks, task);
  }
}

}  // namespace lrjax_cpu
