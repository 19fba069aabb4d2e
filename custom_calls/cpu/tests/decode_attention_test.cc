// C++ unit test of the CPU decode attention (no XLA needed): the body this CPU takes for each
// head dim (decode_attention.h: DecodeAttentionIsa) against a double-precision reference on
// fresh random inputs: head groups of 1-7, head dims 1-136, lengths short of the buffer and
// past the bodies' blocks, windows, positions before, inside and past the attended keys, and
// calls large enough to run on the thread pool.
//
// Usage: decode_attention_test [--require=avx2]  (fails if D % 8 == 0 does not take AVX2)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../decode_attention.h"

namespace {

int g_failures = 0, g_checks = 0;

// The reference: scores / sqrt(D) over the visible keys, softmax, p·V; no visible key: the
// mean of v over [0, length).
void Reference(const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v, const std::vector<int32_t>& pos,
               std::vector<double>& out, int64_t B, int64_t Hq, int64_t Hkv, int64_t T,
               int64_t D, int64_t length, int64_t window) {
  const int64_t G = Hq / Hkv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Hq; ++j) {
      const int64_t h = j / G;
      std::vector<double> s(size_t(length), -INFINITY);
      bool any = false;
      for (int64_t t = 0; t < length; ++t) {
        const bool visible = t <= pos[b] && (window == 0 || pos[b] - t < window);
        if (!visible) continue;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(q[size_t((b * Hq + j) * D + d)]) * k[size_t(((b * Hkv + h) * T + t) * D + d)];
        s[size_t(t)] = dot / std::sqrt(double(D));
        any = true;
      }
      double m = -INFINITY, sum = 0;
      for (double x : s) m = x > m ? x : m;
      for (double& x : s) sum += (x = any ? std::exp(x - m) : 1.0);
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t t = 0; t < length; ++t)
          o += s[size_t(t)] / sum * v[size_t(((b * Hkv + h) * T + t) * D + d)];
        out[size_t((b * Hq + j) * D + d)] = o;
      }
    }
}

void Check(std::mt19937& rng, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D,
           int64_t length, int64_t window, const std::vector<int32_t>& pos) {
  std::normal_distribution<float> n01;
  std::vector<float> q(size_t(B * Hq * D)), k(size_t(B * Hkv * T * D)), v(k.size());
  for (auto& x : q) x = 2 * n01(rng);
  for (auto& x : k) x = n01(rng);
  for (auto& x : v) x = n01(rng);
  std::vector<float> out(q.size(), NAN);
  std::vector<double> want(q.size());
  lrjax_cpu::DecodeAttentionF32(q.data(), k.data(), v.data(), pos.data(), out.data(), B, Hq, Hkv,
                                T, D, length, window);
  Reference(q, k, v, pos, want, B, Hq, Hkv, T, D, length, window);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double excess = std::fabs(out[i] - want[i]) - (1e-4 * std::fabs(want[i]) + 1e-5);
    if (!(excess <= worst)) worst = std::isnan(excess) ? INFINITY : excess, at = i;
  }
  ++g_checks;
  if (worst > 0) {
    ++g_failures;
    std::fprintf(stderr,
                 "FAIL B=%lld Hq=%lld Hkv=%lld T=%lld D=%lld length=%lld window=%lld pos[0]=%d "
                 "(%s): out[%zu] = %g, want %g\n",
                 (long long)B, (long long)Hq, (long long)Hkv, (long long)T, (long long)D,
                 (long long)length, (long long)window, pos[0], lrjax_cpu::DecodeAttentionIsa(D),
                 at, out[at], want[at]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool require_avx2 = argc > 1 && std::strcmp(argv[1], "--require=avx2") == 0;
  std::mt19937 rng(std::random_device{}());
  struct Shape { int64_t B, Hq, Hkv, T, D, length, window; };
  const Shape shapes[] = {
      {2, 32, 8, 300, 64, 280, 0},  // 2.2 MiB of K and V: on the pool; Llama-3.2-1B heads
      {2, 14, 2, 300, 40, 290, 0},  // G = 7, 32- then 8-wide accumulators, 64-key blocks
      {2, 8, 2, 64, 128, 64, 5},    // window
      {3, 7, 1, 40, 100, 33, 0},    // D not a multiple of 8
      {2, 4, 4, 20, 3, 20, 0},      // D under 8
      {1, 2, 1, 1, 16, 1, 0},       // one key
      {2, 6, 3, 50, 136, 37, 7},    // D = 136: four 32-wide chunks and one 8-wide
  };
  for (const Shape& s : shapes) {
    std::uniform_int_distribution<int32_t> inside(0, int32_t(s.length - 1));
    for (int32_t p : {-1, 0, inside(rng), int32_t(s.length - 1), int32_t(s.T + 3)}) {
      std::vector<int32_t> pos(size_t(s.B), p);
      pos[0] = inside(rng);  // rows differ
      Check(rng, s.B, s.Hq, s.Hkv, s.T, s.D, s.length, s.window, pos);
    }
  }
  std::printf("attention body D=64 -> %s, D=100 -> %s\n", lrjax_cpu::DecodeAttentionIsa(64),
              lrjax_cpu::DecodeAttentionIsa(100));
  if (require_avx2 && std::strcmp(lrjax_cpu::DecodeAttentionIsa(64), "avx2") != 0) {
    std::fprintf(stderr, "FAIL: --require=avx2 but D=64 takes %s\n",
                 lrjax_cpu::DecodeAttentionIsa(64));
    ++g_failures;
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
