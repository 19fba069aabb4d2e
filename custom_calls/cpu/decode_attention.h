// Decode attention over a dense KV cache on the CPU: one new query a row against the
// cache buffer in place, the keys past a row's position (and past `length`) never read.
// The reference is lowering/decode_attention.py's (the models' einsum/softmax); this
// kernel computes it in f32 on the calling thread, one (row, KV head) after another.
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

}  // namespace lrjax_cpu
