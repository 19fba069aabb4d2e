// Softmax attention with GQA and a boolean mask on the CPU, for prefill: the models' attention
// (lowering/attention.py) in f32. Each query's scores cover only its visible keys; a block of
// queries of one KV head reads each key and value row once. A query that sees no key gets the
// reference's answer: the mean of v over all T keys. Masked keys are never read (where their
// value rows hold an inf or a NaN, the reference's 0 · v makes a NaN that this kernel does not).
#pragma once
#include <cstdint>

namespace lrjax_cpu {

// q [B, S, Hq, D], k/v [B, T, Hkv, D] (heads_first: [B, Hkv, T, D]), mask [B, S, T] (0 or 1)
// -> out [B, S, Hq * D]; query head j attends with KV head j / (Hq / Hkv).
void AttentionF32(const float* q, const float* k, const float* v, const uint8_t* mask,
                  float* out, int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t T,
                  int64_t D, bool heads_first);

// "avx2" (x86 with AVX2 and FMA, unless LRJAX_W4A8_ISA=scalar) or "scalar".
const char* AttentionIsa();

// --- internal: one (row, KV head, block of queries) per call, one body per ISA -------------
constexpr int64_t kAttnQueryBlock = 8;  // queries a task; with G heads each, G * 8 vectors
struct AttnArgs {
  const float *q, *k, *v;
  const uint8_t* mask;
  float* out;
  int64_t S, Hq, Hkv, T, D;
  int64_t kb, kh, kt;  // element strides of k and v: row b, KV head h, key t
  float root;          // sqrt(D)
};
// Floats of scratch a task needs: its queries' scores over T keys, then their accumulators.
static inline int64_t AttnScratchFloats(const AttnArgs& a) {
  return kAttnQueryBlock * (a.Hq / a.Hkv) * (a.T + a.D);
}
void AttendBlockScalar(const AttnArgs& a, int64_t b, int64_t h, int64_t s0, float* scratch);
void AttendBlockAvx2(const AttnArgs& a, int64_t b, int64_t h, int64_t s0, float* scratch);

}  // namespace lrjax_cpu
