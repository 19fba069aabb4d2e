// C++ unit tests of the W4A8 kernels (no XLA needed): every ISA path this CPU
// runs is compared bit-exactly with the scalar path, the integer part with an
// exact int64 product, and bad shapes must come back as errors.
//
// Usage: w4a8_test [--require=isa1,isa2,...]
//   Fails if a required ISA path (e.g. dotprod,i8mm under qemu -cpu max) cannot run.
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../w4a8.h"

using namespace lrjax_w4a8;

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    ++g_checks;                                                   \
    if (!(cond)) {                                                \
      ++g_failures;                                               \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
    }                                                             \
  } while (0)

// Independent packer: u[k][n] = q + 8, layout as documented in w4a8.h.
std::vector<uint8_t> Pack(const std::vector<int8_t>& q, int64_t K, int64_t N, Layout lay) {
  const int64_t bw = BlockWidth(lay), Kp = RoundUp(K, 8), Np = RoundUp(N, bw);
  auto U = [&](int64_t k, int64_t n) -> int {
    return (k < K && n < N) ? q[size_t(k * N + n)] + 8 : 8;
  };
  std::vector<uint8_t> out(size_t(Np / bw * Kp / 8 * bw * 4));
  for (int64_t nb = 0; nb < Np / bw; ++nb)
    for (int64_t kc = 0; kc < Kp / 8; ++kc) {
      uint8_t* ch = &out[size_t((nb * (Kp / 8) + kc) * bw * 4)];
      const int64_t k0 = 8 * kc, n0 = bw * nb;
      if (lay == Layout::kArm8) {
        for (int h = 0; h < 2; ++h)
          for (int cc = 0; cc < 2; ++cc)
            for (int j = 0; j < 8; ++j)
              ch[16 * h + 8 * cc + j] = uint8_t(U(k0 + j, n0 + 4 * h + cc) << 4 |
                                                U(k0 + j, n0 + 4 * h + 2 + cc));
      } else {
        for (int c = 0; c < bw; ++c)
          for (int j = 0; j < 4; ++j)
            ch[4 * c + j] = uint8_t(U(k0 + j, n0 + c) | U(k0 + 4 + j, n0 + c) << 4);
      }
    }
  return out;
}

struct Case {
  int64_t M, K, N, group;
};

std::vector<Isa> RunnableIsas(Layout lay) {
  std::vector<Isa> out;
  const unsigned mask = CpuIsaMask();
  for (int i = 0; i <= int(Isa::kI8mm); ++i)
    if ((mask >> i & 1) && HasKernel(lay, Isa(i))) out.push_back(Isa(i));
  return out;
}

struct Problem {
  std::vector<int8_t> q;
  std::vector<uint8_t> packed;
  std::vector<float> scales, x, bias;
  Weights w;
};

Problem MakeProblem(std::mt19937& rng, const Case& c, Layout lay) {
  Problem p;
  std::uniform_int_distribution<int> qd(-8, 7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> sd(0.01f, 0.1f);
  p.q.resize(size_t(c.K * c.N));
  for (auto& v : p.q) v = int8_t(qd(rng));
  p.packed = Pack(p.q, c.K, c.N, lay);
  const int64_t Np = RoundUp(c.N, BlockWidth(lay)), G = NumGroups(c.K, c.group);
  p.scales.assign(size_t(G * Np), 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < c.N; ++n) p.scales[size_t(g * Np + n)] = sd(rng);
  p.x.resize(size_t(c.M * c.K));
  for (auto& v : p.x) v = nd(rng);
  p.bias.resize(size_t(c.N));
  for (auto& v : p.bias) v = nd(rng);
  p.w = Weights{p.packed.data(), p.scales.data(), c.K, c.N, c.group, lay};
  return p;
}

void TestMatchesScalar(std::mt19937& rng, Layout lay, std::vector<std::string>& ran) {
  const Case cases[] = {{1, 64, 16, 32},  {1, 200, 45, 64},  {3, 300, 70, 0},
                        {7, 136, 33, 128}, {13, 96, 100, 32}, {32, 520, 64, 128},
                        {9, 8, 5, 0}};
  for (const Case& c : cases) {
    Problem p = MakeProblem(rng, c, lay);
    for (int with_bias = 0; with_bias < 2; ++with_bias)
      for (DType yd : {DType::kF32, DType::kBF16}) {
        const size_t esz = yd == DType::kF32 ? 4 : 2;
        std::vector<char> ref(size_t(c.M * c.N) * esz), out(ref.size());
        const float* b = with_bias ? p.bias.data() : nullptr;
        std::string e = Matmul(p.x.data(), DType::kF32, c.M, p.w, b, ref.data(), yd,
                               int(Isa::kScalar));
        CHECK(e.empty(), "scalar: %s", e.c_str());
        for (Isa isa : RunnableIsas(lay)) {
          std::memset(out.data(), 0x7f, out.size());
          e = Matmul(p.x.data(), DType::kF32, c.M, p.w, b, out.data(), yd, int(isa));
          CHECK(e.empty(), "%s: %s", IsaName(isa), e.c_str());
          CHECK(std::memcmp(out.data(), ref.data(), ref.size()) == 0,
                "%s/%s M=%lld K=%lld N=%lld group=%lld bias=%d bf16=%d differs from scalar",
                LayoutName(lay), IsaName(isa), (long long)c.M, (long long)c.K,
                (long long)c.N, (long long)c.group, with_bias, int(yd == DType::kBF16));
          const std::string tag = std::string(LayoutName(lay)) + "/" + IsaName(isa);
          bool seen = false;
          for (auto& t : ran) seen |= t == tag;
          if (!seen) ran.push_back(tag);
        }
      }
  }
}

// Integer-valued x with row abs-max 127 quantizes exactly (sa = 1); with unit
// per-channel scales y is the exact integer product.
void TestIntegerExact(std::mt19937& rng, Layout lay) {
  const Case c{5, 1000, 37, 0};
  Problem p = MakeProblem(rng, c, lay);
  std::fill(p.scales.begin(), p.scales.end(), 1.f);
  std::uniform_int_distribution<int> xd(-127, 127);
  for (int64_t m = 0; m < c.M; ++m) {
    for (int64_t k = 0; k < c.K; ++k) p.x[size_t(m * c.K + k)] = float(xd(rng));
    p.x[size_t(m * c.K + m)] = (m % 2) ? -127.f : 127.f;
  }
  for (Isa isa : RunnableIsas(lay)) {
    std::vector<float> y(size_t(c.M * c.N));
    std::string e = Matmul(p.x.data(), DType::kF32, c.M, p.w, nullptr, y.data(), DType::kF32,
                           int(isa));
    CHECK(e.empty(), "%s", e.c_str());
    int bad = 0;
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        int64_t s = 0;
        for (int64_t k = 0; k < c.K; ++k)
          s += int64_t(p.x[size_t(m * c.K + k)]) * p.q[size_t(k * c.N + n)];
        bad += y[size_t(m * c.N + n)] != float(s);
      }
    CHECK(bad == 0, "%s/%s: %d integer outputs differ from the exact product", LayoutName(lay),
          IsaName(isa), bad);
  }
}

void TestLowRankMatchesScalar(std::mt19937& rng, Layout lay) {
  const Case cu{11, 150, 40, 32}, cv{11, 40, 70, 0};
  Problem pu = MakeProblem(rng, cu, lay), pv = MakeProblem(rng, cv, lay);
  std::vector<float> ref(size_t(cu.M * cv.N)), out(ref.size());
  std::string e = LowRankMatmul(pu.x.data(), DType::kF32, cu.M, pu.w, pv.w, pv.bias.data(),
                                ref.data(), DType::kF32, int(Isa::kScalar));
  CHECK(e.empty(), "%s", e.c_str());
  for (Isa isa : RunnableIsas(lay)) {
    e = LowRankMatmul(pu.x.data(), DType::kF32, cu.M, pu.w, pv.w, pv.bias.data(), out.data(),
                      DType::kF32, int(isa));
    CHECK(e.empty(), "%s", e.c_str());
    CHECK(std::memcmp(out.data(), ref.data(), 4 * ref.size()) == 0,
          "low rank %s/%s differs from scalar", LayoutName(lay), IsaName(isa));
  }
}

void TestBadShapes() {
  Weights w{nullptr, nullptr, 100, 30, 32, Layout::kX86};
  // Expected packed (2, 13, 64), scales (4, 32).
  CHECK(CheckWeights(w, 2, 13, 64, 4, 32).empty(), "good shape rejected");
  CHECK(!CheckWeights(w, 2, 12, 64, 4, 32).empty(), "short packed K accepted");
  CHECK(!CheckWeights(w, 1, 13, 64, 4, 32).empty(), "short packed N accepted");
  CHECK(!CheckWeights(w, 2, 13, 64, 3, 32).empty(), "short scales accepted");
  w.group = 12;
  CHECK(!CheckWeights(w, 2, 13, 64, 9, 32).empty(), "group 12 accepted");
  w.group = 32;
  w.layout = Layout(7);
  CHECK(!CheckWeights(w, 2, 13, 64, 4, 32).empty(), "layout 7 accepted");
  Weights u{nullptr, nullptr, 64, 16, 32, Layout::kX86}, v{nullptr, nullptr, 8, 16, 0,
                                                          Layout::kX86};
  float y[16];
  CHECK(!LowRankMatmul(y, DType::kF32, 1, u, v, nullptr, y, DType::kF32).empty(),
        "rank mismatch accepted");
}

// Rows with NaN or inf give the IEEE sum of their non-finite terms x[k]*w[k][n]
// (w = q*s), on every ISA path, also in the low-rank X·U·V; finite rows beside
// them are unaffected.
void TestNonFinite(std::mt19937& rng, Layout lay) {
  const float inf = INFINITY, nan = NAN;
  const Case c{6, 72, 21, 32};
  Problem p = MakeProblem(rng, c, lay);
  for (int64_t n = 0; n < c.N; n += 5) p.q[size_t(3 * c.N + n)] = 0;  // an inf meets zeros
  p.packed = Pack(p.q, c.K, c.N, lay);
  p.w.packed = p.packed.data();
  std::vector<float> x = p.x;
  auto X = [&](int64_t m, int64_t k) -> float& { return x[size_t(m * c.K + k)]; };
  X(0, 10) = nan;                  // NaN row
  X(1, 3) = inf;                   // one +inf (zero weights at some n)
  X(2, 40) = -inf;                 // one -inf
  X(3, 7) = inf, X(3, 50) = -inf;  // both signs
  X(4, 0) = inf, X(4, 70) = inf;   // two +inf in different groups
  const int64_t Np = RoundUp(c.N, BlockWidth(lay));
  std::vector<float> ref(size_t(c.M * c.N)), out(ref.size());
  std::string e = Matmul(x.data(), DType::kF32, c.M, p.w, p.bias.data(), ref.data(), DType::kF32,
                         int(Isa::kScalar));
  CHECK(e.empty(), "%s", e.c_str());
  int bad = 0;
  for (int64_t m = 0; m < 5; ++m)
    for (int64_t n = 0; n < c.N; ++n) {
      float want = 0.f;
      for (int64_t k = 0; k < c.K; ++k)
        if (!std::isfinite(X(m, k)))
          want += X(m, k) * (float(p.q[size_t(k * c.N + n)]) * p.scales[size_t(k / 32 * Np + n)]);
      want += p.bias[size_t(n)];
      const float got = ref[size_t(m * c.N + n)];
      bad += !(std::isnan(want) ? std::isnan(got) : got == want);
    }
  CHECK(bad == 0, "%s: %d non-finite outputs differ from IEEE f32 math", LayoutName(lay), bad);
  int finite = 0;
  for (int64_t n = 0; n < c.N; ++n) finite += std::isfinite(ref[size_t(5 * c.N + n)]);
  CHECK(finite == c.N, "%s: a finite row next to non-finite ones is not finite", LayoutName(lay));
  for (Isa isa : RunnableIsas(lay)) {
    e = Matmul(x.data(), DType::kF32, c.M, p.w, p.bias.data(), out.data(), DType::kF32, int(isa));
    CHECK(e.empty() && std::memcmp(out.data(), ref.data(), 4 * ref.size()) == 0,
          "non-finite %s/%s differs from scalar", LayoutName(lay), IsaName(isa));
  }
  // Low rank: the rank-space row of a non-finite row is non-finite in turn.
  const Case cv{c.M, c.N, 13, 0};
  Problem pv = MakeProblem(rng, cv, lay);
  std::vector<float> t(size_t(c.M * c.N)), y2(size_t(c.M * cv.N)), y1(y2.size());
  e = Matmul(x.data(), DType::kF32, c.M, p.w, nullptr, t.data(), DType::kF32, int(Isa::kScalar));
  CHECK(e.empty(), "%s", e.c_str());
  e = Matmul(t.data(), DType::kF32, c.M, pv.w, pv.bias.data(), y2.data(), DType::kF32,
             int(Isa::kScalar));
  CHECK(e.empty(), "%s", e.c_str());
  for (Isa isa : RunnableIsas(lay)) {
    e = LowRankMatmul(x.data(), DType::kF32, c.M, p.w, pv.w, pv.bias.data(), y1.data(),
                      DType::kF32, int(isa));
    CHECK(e.empty() && std::memcmp(y1.data(), y2.data(), 4 * y2.size()) == 0,
          "non-finite low rank %s/%s differs from the two-matmul chain", LayoutName(lay),
          IsaName(isa));
  }
  int nan_row = 0;
  for (int64_t n = 0; n < cv.N; ++n) nan_row += std::isnan(y1[size_t(n)]);
  CHECK(nan_row == cv.N, "low rank: a NaN row came out with %d NaNs of %lld", nan_row,
        (long long)cv.N);
}

// A row so small that 127/amax would overflow (amax < 2^-96) is computed in f32
// over the dequantized weights, a small one is quantized as usual: both match
// the f64 product to W4A8 accuracy.
void TestTinyRows(std::mt19937& rng, Layout lay) {
  const Case c{3, 256, 40, 64};
  Problem p = MakeProblem(rng, c, lay);
  const float scale[3] = {1e-36f, 1e-25f, 1.f};
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t k = 0; k < c.K; ++k) p.x[size_t(m * c.K + k)] *= scale[m];
  std::vector<float> y(size_t(c.M * c.N));
  std::string e = Matmul(p.x.data(), DType::kF32, c.M, p.w, nullptr, y.data(), DType::kF32);
  CHECK(e.empty(), "%s", e.c_str());
  const int64_t Np = RoundUp(c.N, BlockWidth(lay));
  for (int64_t m = 0; m < c.M; ++m) {
    double num = 0, den = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < c.K; ++k)
        want += double(p.x[size_t(m * c.K + k)]) * p.q[size_t(k * c.N + n)] *
                p.scales[size_t(k / 64 * Np + n)];
      num += (y[size_t(m * c.N + n)] - want) * (y[size_t(m * c.N + n)] - want);
      den += want * want;
    }
    CHECK(den > 0 && num / den < 1e-3, "%s: row scaled by %g has NMSE %g vs f64", LayoutName(lay),
          double(scale[m]), den > 0 ? num / den : -1.0);
  }
}

void TestThreadsFromEnv() {
  std::string w;
  CHECK(ThreadsFor(nullptr, 2, &w) == 2 && w.empty(), "unset env: hardware threads");
  CHECK(ThreadsFor("", 2, &w) == 2 && w.empty(), "empty env: hardware threads");
  CHECK(ThreadsFor("1", 2, &w) == 1 && w.empty(), "LRJAX_W4A8_THREADS=1");
  CHECK(ThreadsFor("100000", 2, &w) == 2 && w.find("exceeds") != std::string::npos,
        "100000 threads must be capped at the hardware threads with a warning");
  for (const char* bad : {"abc", "4x", "0", "-3", "+2", " 2", "1.5", "99999999999999999999999"}) {
    w.clear();
    CHECK(ThreadsFor(bad, 8, &w) == 8 && w.find("not a positive integer") != std::string::npos,
          "LRJAX_W4A8_THREADS=%s must be rejected with a warning", bad);
  }
  w.clear();
  CHECK(ThreadsFor("100000", 0, &w) == kMaxThreadsUnknownHw && !w.empty(),
        "unknown hardware: capped at %d", kMaxThreadsUnknownHw);
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  CHECK(NumThreads() >= 1 && unsigned(NumThreads()) <= hw,
        "NumThreads() = %d exceeds the %u hardware threads", NumThreads(), hw);
}

void TestSpinFromEnv() {
  std::string w;
  CHECK(SpinUsFor(nullptr, &w) == kDefaultSpinUs && w.empty(), "unset env: the default spin");
  CHECK(SpinUsFor("0", &w) == 0 && w.empty(), "LRJAX_W4A8_SPIN_US=0: sleep at once");
  CHECK(SpinUsFor("1000000", &w) == kMaxSpinUs && w.empty(), "the largest spin");
  for (const char* bad : {"abc", "-1", "+5", " 5", "1.5", "1000001", "99999999999"}) {
    w.clear();
    CHECK(SpinUsFor(bad, &w) == kDefaultSpinUs && w.find("not an integer") != std::string::npos,
          "LRJAX_W4A8_SPIN_US=%s must be rejected with a warning", bad);
  }
}

// The pool's workers run under the calling thread's floating-point environment:
// with flush-to-zero and denormals-are-zero set by the caller (as XLA does),
// denormal weight scales read as zero on every thread, not only the caller's.
void TestWorkersFollowCallerFpEnv(std::mt19937& rng) {
  const Case c{64, 512, 256, 32};
  Problem p = MakeProblem(rng, c, Layout::kX86);
  for (auto& s : p.scales) s *= 1e-38f;  // denormal
  std::vector<float> y(size_t(c.M * c.N));
  std::string e = Matmul(p.x.data(), DType::kF32, c.M, p.w, nullptr, y.data(), DType::kF32);
  CHECK(e.empty(), "%s", e.c_str());  // the pool exists now, made by a thread without FTZ
  std::fenv_t saved, flush;
  std::fegetenv(&saved);
  flush = saved;
#if defined(__x86_64__)
  flush.__mxcsr |= 0x8040;  // FTZ | DAZ
#elif defined(__aarch64__)
  flush.__fpcr |= 1u << 24;  // FZ
#endif
  std::fesetenv(&flush);
  for (Isa isa : RunnableIsas(Layout::kX86)) {
    e = Matmul(p.x.data(), DType::kF32, c.M, p.w, nullptr, y.data(), DType::kF32, int(isa));
    int nonzero = 0;
    for (float v : y) nonzero += v != 0.f;
    CHECK(e.empty() && nonzero == 0,
          "%s: %d outputs read denormal scales as non-zero under the caller's flush-to-zero",
          IsaName(isa), nonzero);
  }
  std::fesetenv(&saved);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> required;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--require=", 0) == 0) {
      std::string s = a.substr(10);
      for (size_t pos = 0; pos <= s.size();) {
        size_t comma = s.find(',', pos);
        if (comma == std::string::npos) comma = s.size();
        if (comma > pos) required.push_back(s.substr(pos, comma - pos));
        pos = comma + 1;
      }
    }
  }
  std::mt19937 rng(std::random_device{}());
  std::vector<std::string> ran;
  for (Layout lay : {Layout::kX86, Layout::kArm4, Layout::kArm8}) {
    TestMatchesScalar(rng, lay, ran);
    TestIntegerExact(rng, lay);
    TestLowRankMatchesScalar(rng, lay);
    TestNonFinite(rng, lay);
    TestTinyRows(rng, lay);
  }
  TestBadShapes();
  TestThreadsFromEnv();
  TestSpinFromEnv();
  TestWorkersFollowCallerFpEnv(rng);
  // Dispatch: SelectIsa honours LRJAX_W4A8_ISA and never picks what the CPU lacks.
  for (Layout lay : {Layout::kX86, Layout::kArm4, Layout::kArm8}) {
    const Isa sel = SelectIsa(lay);
    std::printf("dispatch %s -> %s\n", LayoutName(lay), IsaName(sel));
    CHECK(CpuIsaMask() >> int(sel) & 1, "selected %s, which the CPU lacks", IsaName(sel));
    if (const char* env = std::getenv("LRJAX_W4A8_ISA")) {
      bool known = false;
      for (int i = 0; i <= int(Isa::kI8mm); ++i)
        if (std::strcmp(env, IsaName(Isa(i))) == 0) {
          known = true;
          CHECK(int(sel) <= i, "LRJAX_W4A8_ISA=%s but selected %s", env, IsaName(sel));
        }
      CHECK(known, "LRJAX_W4A8_ISA=%s is not an ISA name", env);
    }
  }
  std::printf("paths tested:");
  for (auto& s : ran) std::printf(" %s", s.c_str());
  std::printf("\n");
  for (auto& r : required) {
    bool found = false;
    for (auto& s : ran) found |= s.size() > r.size() && s.compare(s.size() - r.size(), r.size(), r) == 0;
    CHECK(found, "required ISA path %s did not run on this CPU", r.c_str());
  }
  std::printf("%d checks, %d failures, %d threads\n", g_checks, g_failures, NumThreads());
  return g_failures == 0 ? 0 : 1;
}
