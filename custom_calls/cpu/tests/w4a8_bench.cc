// Native micro-benchmark of the W4A8 GEMM (no XLA): median time per call of
// Matmul for K = N = 4096 over a range of M, one L3-resident weight.
// Build: see run_native_tests.sh flags; usage: w4a8_bench [group] [isa-name]
// The committed, side-by-side numbers come from benchmarks/cpu_w4a8.py.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../w4a8.h"

using namespace lrjax_w4a8;

int main(int argc, char** argv) {
  const int64_t K = 4096, N = 4096;
  const int64_t group = argc > 1 ? std::atoi(argv[1]) : 128;
  int isa = -1;
  for (int i = 0; argc > 2 && i <= int(Isa::kI8mm); ++i)
    if (std::strcmp(argv[2], IsaName(Isa(i))) == 0) isa = i;
  const Layout lay = SelectIsa(Layout::kX86) != Isa::kScalar ? Layout::kX86 : Layout::kArm4;
  const int bw = BlockWidth(lay);
  const int64_t Kp = RoundUp(K, 8), Np = RoundUp(N, bw), G = NumGroups(K, group);
  std::vector<uint8_t> packed(size_t(Np / bw * Kp / 8 * bw * 4));
  std::mt19937 rng(1);
  for (auto& b : packed) b = uint8_t(rng());
  std::vector<float> scales(size_t(G * Np), 0.01f);
  Weights w{packed.data(), scales.data(), K, N, group, lay};
  std::printf("layout %s isa %s threads %d group %lld\n", LayoutName(lay),
              IsaName(isa < 0 ? SelectIsa(lay) : Isa(isa)), NumThreads(), (long long)group);
  for (int64_t M : {1, 8, 32, 64, 128, 256, 1024}) {
    std::vector<float> x(size_t(M * K)), y(size_t(M * N));
    for (auto& v : x) v = float(rng() % 1000) / 500.f - 1.f;
    std::vector<double> ts;
    const int iters = M >= 512 ? 7 : 40;
    for (int i = 0; i < iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      Matmul(x.data(), DType::kF32, M, w, nullptr, y.data(), DType::kF32, isa);
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    const double t = ts[ts.size() / 2];
    std::printf("M=%5lld: %10.1f us %8.1f GFLOP/s\n", (long long)M, t * 1e6, 2.0 * M * K * N / t / 1e9);
  }
  return 0;
}
