// W4A8 driver: activation quantization, CPU dispatch, the owned thread pool,
// the scalar reference tile and the epilogue. Compiled for the baseline ISA with
// -ffp-contract=off (see w4a8.h for the numerics every path reproduces).
#include "w4a8.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cfenv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace lrjax_w4a8 {

// ------------------------------------------------------------------ metadata

int BlockWidth(Layout layout) {
  switch (layout) {
    case Layout::kX86: return 16;
    case Layout::kArm4: return 4;
    case Layout::kArm8: return 8;
  }
  return 0;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvxVnni: return "avxvnni";
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kNeon: return "neon";
    case Isa::kDotprod: return "dotprod";
    case Isa::kI8mm: return "i8mm";
  }
  return "?";
}

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kX86: return "x86_vnni";
    case Layout::kArm4: return "arm_sdot4";
    case Layout::kArm8: return "arm_smmla8";
  }
  return "?";
}

unsigned CpuIsaMask() {
  unsigned m = 1u << int(Isa::kScalar);
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) m |= 1u << int(Isa::kAvx2);
  if ((m >> int(Isa::kAvx2) & 1) && __builtin_cpu_supports("avxvnni")) m |= 1u << int(Isa::kAvxVnni);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    m |= 1u << int(Isa::kAvx512Vnni);
#elif defined(__aarch64__)
  m |= 1u << int(Isa::kNeon);
#if defined(__linux__)
  unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw & HWCAP_ASIMDDP) m |= 1u << int(Isa::kDotprod);
  if (hw2 & HWCAP2_I8MM) m |= 1u << int(Isa::kI8mm);
#endif
#endif
  return m;
}

Tile GetTile(Layout layout, Isa isa) {
  // {fn, mr, nc, mr1, nc1}: preferred tiles for M > 1 and M == 1.
  switch (layout) {
    case Layout::kX86:
      switch (isa) {
#if defined(LRJAX_W4A8_X86)
        case Isa::kAvx512Vnni: return {TileX86Avx512Vnni, 6, 32, 1, 64};
        case Isa::kAvxVnni: return {TileX86AvxVnni, 2, 16, 1, 32};
        case Isa::kAvx2: return {TileX86Avx2, 2, 16, 1, 32};
#endif
        case Isa::kScalar: return {TileScalar, 4, 16, 1, 16};
        default: break;
      }
      break;
    case Layout::kArm4:
      switch (isa) {
#if defined(LRJAX_W4A8_ARM)
        case Isa::kDotprod: return {TileArm4Dotprod, 4, 8, 1, 16};
        case Isa::kNeon: return {TileArm4Neon, 2, 8, 1, 16};
#endif
        case Isa::kScalar: return {TileScalar, 4, 16, 1, 16};
        default: break;
      }
      break;
    case Layout::kArm8:
      switch (isa) {
#if defined(LRJAX_W4A8_ARM)
        case Isa::kI8mm: return {TileArm8I8mm, 4, 8, 1, 16};
#endif
        case Isa::kScalar: return {TileScalar, 4, 16, 1, 16};
        default: break;
      }
      break;
  }
  return {nullptr, 0, 0, 0, 0};
}

bool HasKernel(Layout layout, Isa isa) { return GetTile(layout, isa).fn != nullptr; }

namespace {

const Isa kOrder[] = {Isa::kI8mm, Isa::kDotprod, Isa::kNeon, Isa::kAvx512Vnni,
                      Isa::kAvxVnni, Isa::kAvx2, Isa::kScalar};

// The ISA LRJAX_W4A8_ISA names, as an int; -1 when unset or unknown (no cap).
int IsaCap() {
  int cap = -1;
  if (const char* env = std::getenv("LRJAX_W4A8_ISA")) {
    for (Isa i : kOrder)
      if (std::strcmp(env, IsaName(i)) == 0) cap = int(i);
  }
  return cap;
}

}  // namespace

bool IsaAllowed(Isa isa) {
  const int cap = IsaCap();
  return (CpuIsaMask() >> int(isa) & 1) && (cap < 0 || int(isa) <= cap);
}

Isa SelectIsa(Layout layout) {
  unsigned mask = CpuIsaMask();
  const int cap = IsaCap();
  // Within each architecture the enum order is the preference order.
  Isa best = Isa::kScalar;
  for (Isa i : kOrder) {
    if (!(mask >> int(i) & 1) || !HasKernel(layout, i)) continue;
    if (cap >= 0 && int(i) > cap) continue;
    if (int(i) > int(best)) best = i;
  }
  return best;
}

int64_t NumGroups(int64_t K, int64_t group) { return group == 0 ? 1 : (K + group - 1) / group; }

std::string CheckWeights(const Weights& w, int64_t d0, int64_t d1, int64_t d2, int64_t s0,
                         int64_t s1) {
  if (w.K <= 0 || w.N <= 0)
    return "K=" + std::to_string(w.K) + " and N=" + std::to_string(w.N) + " must be positive";
  if (w.group < 0 || w.group % 8 != 0)
    return "group=" + std::to_string(w.group) + " must be 0 (per channel) or a multiple of 8";
  int lay = int(w.layout);
  if (lay < 0 || lay > 2) return "layout=" + std::to_string(lay) + " must be 0, 1 or 2";
  const int64_t bw = BlockWidth(w.layout), Kp = RoundUp(w.K, 8), Np = RoundUp(w.N, bw);
  // int32 sums of one group: |sum| <= len * 15 * 127 must stay below 2^31.
  const int64_t glen = w.group == 0 ? Kp : std::min(w.group, Kp);
  if (glen > (int64_t(1) << 20))
    return "group length " + std::to_string(glen) + " > 2^20 would overflow int32 sums; use group=128";
  if (d0 != Np / bw || d1 != Kp / 8 || d2 != bw * 4)
    return "packed weight shape (" + std::to_string(d0) + ", " + std::to_string(d1) + ", " +
           std::to_string(d2) + ") != expected (" + std::to_string(Np / bw) + ", " +
           std::to_string(Kp / 8) + ", " + std::to_string(bw * 4) + ") for K=" +
           std::to_string(w.K) + ", N=" + std::to_string(w.N) + ", layout " +
           LayoutName(w.layout);
  const int64_t G = NumGroups(w.K, w.group);
  if (s0 != G || s1 != Np)
    return "scales shape (" + std::to_string(s0) + ", " + std::to_string(s1) +
           ") != expected (" + std::to_string(G) + ", " + std::to_string(Np) + ") for K=" +
           std::to_string(w.K) + ", group=" + std::to_string(w.group);
  return "";
}

// --------------------------------------------------------------- thread pool

namespace {

int SpinUs() {
  std::string warning;
  const int us = SpinUsFor(std::getenv("LRJAX_W4A8_SPIN_US"), &warning);
  if (!warning.empty()) std::fprintf(stderr, "lrjax W4A8: %s\n", warning.c_str());
  return us;
}

class Pool {
 public:
  Pool(int n, int spin_us) : spin_(spin_us) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }

  // Runs fn(0..n-1); each index exactly once, by whichever thread claims it; the
  // caller works too and returns once all n are done, without waiting for workers
  // that never woke (a busy machine). A call that finds the pool busy (another
  // XLA thread) runs its tasks inline. Workers run under the caller's
  // floating-point environment (rounding, flush-to-zero), so results never
  // depend on the thread. After a job, workers spin for up to spin_
  // (LRJAX_W4A8_SPIN_US) before sleeping: a W4A8 decode step's calls come
  // microseconds apart, and waking a sleeping thread costs tens of microseconds.
  // They spin only while jobs come that close: when the gap before this job was
  // longer than spin_ (e.g. one attention call a layer among XLA's own dots, whose
  // threads need the cores), they sleep at once.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(job_mu_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    const int64_t start = NowNs();
    const int64_t last = last_end_ns_.load();
    spin_after_.store(last != 0 && start - last <= spin_ns_);
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    std::fegetenv(&job->env);
    bool wake;
    {
      std::lock_guard<std::mutex> l(mu_);
      job_ = job;
      gen_.fetch_add(1);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    Run(*job);
    if (!SpinUntil([&] { return job->done.load() == n; })) {
      std::unique_lock<std::mutex> l(mu_);
      done_cv_.wait(l, [&] { return job->done.load() == n; });
    }
    std::lock_guard<std::mutex> l(mu_);
    job_.reset();
    last_end_ns_.store(NowNs());
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t n = 0;
    std::fenv_t env;  // the caller's
    std::atomic<int64_t> next{0}, done{0};
  };

  // Whether `ready` held within spin_.
  template <typename F>
  bool SpinUntil(F ready) const {
    if (spin_.count() == 0) return ready();
    const auto end = std::chrono::steady_clock::now() + spin_;
    for (int i = 0;; ++i) {
      if (ready()) return true;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > end) return false;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield");
#endif
    }
  }

  // Claims and runs tasks; `fn` is only called for a claimed index < n, while the
  // caller is still waiting, so it is alive.
  void Run(Job& j) {
    int64_t ran = 0;
    for (int64_t i; (i = j.next.fetch_add(1)) < j.n; ++ran) (*j.fn)(i);
    if (ran && j.done.fetch_add(ran) + ran == j.n) {
      std::lock_guard<std::mutex> l(mu_);
      done_cv_.notify_all();
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      if (spin_after_.load()) SpinUntil([&] { return stop_.load() || gen_.load() != seen; });
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> l(mu_);
        ++sleepers_;
        cv_.wait(l, [&] { return stop_.load() || gen_.load() != seen; });
        --sleepers_;
        if (stop_.load()) return;
        seen = gen_.load();
        job = job_;
      }
      if (job) {
        std::fenv_t own;
        std::fegetenv(&own);
        std::fesetenv(&job->env);
        Run(*job);
        std::fesetenv(&own);
      }
    }
  }

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  const std::chrono::microseconds spin_;
  const int64_t spin_ns_ = spin_.count() * 1000;
  std::atomic<int64_t> last_end_ns_{0};  // when the last job finished (0: none yet)
  std::atomic<bool> spin_after_{false};  // whether workers spin after the current job
  std::vector<std::thread> workers_;
  std::mutex job_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::shared_ptr<Job> job_;  // under mu_
  std::atomic<uint64_t> gen_{0};  // written under mu_
  int sleepers_ = 0;  // workers in cv_.wait, under mu_
  std::atomic<bool> stop_{false};
};

Pool& GetPool() {
  static Pool* pool = new Pool(NumThreads(), SpinUs());  // leaked: workers outlive static dtors
  return *pool;
}

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Quantized activations for one GEMM: xq [Mp, Kp], xinit [Mp, G], sa [M].
struct QAct {
  std::vector<int8_t> xq, xpairs;
  std::vector<int32_t> xinit;
  std::vector<float> sa;
  int64_t M = 0, Mp = 0, Kp = 0, G = 0;
};

// Quantizes one row of n floats into q[Kp] (zero padded); returns the scale, or
// NaN (with q all zero) for a row that is not quantized: one holding a NaN or an
// inf, or with 0 < amax < 2^-96 (127/amax would overflow, or sa underflow, near
// there). ExactRow computes those rows' outputs.
float QuantizeRow(const float* x, int64_t n, int64_t Kp, int8_t* q) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    const float a = std::fabs(x[k]);
    finite &= a <= 3.40282347e38f;  // false for inf and NaN
    amax = std::max(amax, a);
  }
  if (!finite || (amax > 0.f && amax < kMinRowAmax)) {
    std::memset(q, 0, size_t(Kp));
    return std::nanf("");
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const float magic = 12582912.f;  // 1.5 * 2^23: (v + magic) - magic rounds half to even
  for (int64_t k = 0; k < n; ++k) {
    float v = x[k] * inv;
    v = (v + magic) - magic;
    v = std::min(127.f, std::max(-127.f, v));
    q[k] = int8_t(int(v));
  }
  for (int64_t k = n; k < Kp; ++k) q[k] = 0;
  return amax / 127.f;
}

void FinishRow(const int8_t* q, int64_t Kp, int64_t G, int64_t group, int32_t* init) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * group, k1 = std::min(k0 + group, Kp);
    int32_t s = 0;
    for (int64_t k = k0; k < k1; ++k) s += q[k];
    init[g] = -8 * s;
  }
}

void Prepare(QAct& a, int64_t M, int64_t Kp, int64_t G, bool pairs) {
  a.M = M;
  a.Mp = RoundUp(M, 2);
  a.Kp = Kp;
  a.G = G;
  a.xq.assign(size_t(a.Mp * Kp), 0);
  a.xinit.assign(size_t(a.Mp * G), 0);
  a.sa.assign(size_t(M), 0.f);
  if (pairs) a.xpairs.assign(size_t(a.Mp * Kp), 0);
}

// Row pairs for smmla: [Mp/2, Kp/8, 16].
void MakePairs(QAct& a, int64_t m0, int64_t m1) {
  for (int64_t p = m0 / 2; p < (m1 + 1) / 2; ++p)
    for (int64_t kc = 0; kc < a.Kp / 8; ++kc)
      for (int r = 0; r < 2; ++r)
        std::memcpy(&a.xpairs[size_t((p * (a.Kp / 8) + kc) * 16 + 8 * r)],
                    &a.xq[size_t((2 * p + r) * a.Kp + 8 * kc)], 8);
}

void QuantizeInput(const void* x, DType dt, int64_t M, int64_t K, int64_t group, QAct& a,
                   bool pairs) {
  const int64_t Kp = RoundUp(K, 8), grp = group == 0 ? Kp : group;
  Prepare(a, M, Kp, NumGroups(K, group), pairs);
  const int64_t rows_per_task = RoundUp(std::max<int64_t>(1, (1 << 16) / Kp), 2);  // even: pairs
  const int64_t tasks = (M + rows_per_task - 1) / rows_per_task;
  GetPool().ParallelFor(tasks, [&](int64_t t) {
    std::vector<float> buf(dt == DType::kBF16 ? size_t(K) : 0);
    const int64_t m0 = t * rows_per_task, m1 = std::min(M, m0 + rows_per_task);
    for (int64_t m = m0; m < m1; ++m) {
      const float* row;
      if (dt == DType::kF32) {
        row = static_cast<const float*>(x) + m * K;
      } else {
        const uint16_t* b = static_cast<const uint16_t*>(x) + m * K;
        for (int64_t k = 0; k < K; ++k) buf[size_t(k)] = Bf16ToF32(b[k]);
        row = buf.data();
      }
      int8_t* q = &a.xq[size_t(m * Kp)];
      a.sa[size_t(m)] = QuantizeRow(row, K, Kp, q);
      FinishRow(q, Kp, a.G, grp, &a.xinit[size_t(m * a.G)]);
    }
    if (pairs) MakePairs(a, m0, m1);
  });
}

// Runs tiles over rows [0, M) of `a` and columns [0, N) of `w`; epi(m, n0, nc, acc_row)
// consumes each finished tile row.
template <typename Epi>
void RunGemm(const QAct& a, const Weights& w, Isa isa, const Epi& epi) {
  const Tile tile = GetTile(w.layout, isa);
  const int64_t bw = BlockWidth(w.layout), Np = RoundUp(w.N, bw);
  TileArgs ta{a.xq.data(), a.xpairs.empty() ? nullptr : a.xpairs.data(), a.xinit.data(),
              w.packed, w.scales, a.Kp, a.G, Np, w.group == 0 ? a.Kp : w.group, w.layout};
  const int64_t M = a.M;
  const int mr = M == 1 ? tile.mr1 : tile.mr;
  const int nc = M == 1 ? tile.nc1 : tile.nc;
  const int64_t npanels = (w.N + nc - 1) / nc;
  const int T = GetPool().size();
  // Row chunks of ~256 KiB of activations stay in L2 while column panels stream
  // by; with few panels, smaller chunks give every thread work.
  int64_t mchunk = RoundUp(std::max<int64_t>(1, (256 << 10) / a.Kp), mr);
  if (npanels < 4 * T) {
    const int64_t want = (4 * T + npanels - 1) / npanels;
    mchunk = std::min(mchunk, RoundUp((M + want - 1) / want, mr));
  }
  mchunk = std::min(mchunk, RoundUp(M, mr));
  const int64_t msplit = (M + mchunk - 1) / mchunk;
  // Consecutive tasks share a row chunk, so concurrent threads reuse it in L3.
  GetPool().ParallelFor(npanels * msplit, [&](int64_t task) {
    const int64_t mc = task / npanels, p = task % npanels;
    const int64_t n0 = p * nc;
    const int ncc = int(std::min<int64_t>(nc, Np - n0));
    alignas(64) float acc[kTileM * kTileN];
    const int64_t mend = std::min(M, (mc + 1) * mchunk);
    for (int64_t m0 = mc * mchunk; m0 < mend; m0 += mr) {
      const int mrr = int(std::min<int64_t>(mr, mend - m0));
      tile.fn(ta, m0, mrr, n0, ncc, acc);
      const int valid = int(std::min<int64_t>(ncc, w.N - n0));
      for (int r = 0; r < mrr; ++r) epi(m0 + r, n0, valid, acc + r * kTileN);
    }
  });
}

void StoreRow(float sa, const float* acc, const float* bias, int n, void* dst, DType dt) {
  if (dt == DType::kF32) {
    float* y = static_cast<float*>(dst);
    if (bias) {
      for (int j = 0; j < n; ++j) y[j] = acc[j] * sa + bias[j];
    } else {
      for (int j = 0; j < n; ++j) y[j] = acc[j] * sa;
    }
  } else {
    uint16_t* y = static_cast<uint16_t*>(dst);
    for (int j = 0; j < n; ++j) {
      float v = acc[j] * sa;
      if (bias) v = v + bias[j];
      y[j] = F32ToBf16(v);
    }
  }
}

std::string CheckIsa(Layout layout, int isa, Isa* out) {
  if (isa < 0) {
    *out = SelectIsa(layout);
    return "";
  }
  if (isa > int(Isa::kI8mm)) return "isa=" + std::to_string(isa) + " is unknown";
  *out = Isa(isa);
  if (!(CpuIsaMask() >> isa & 1)) return std::string("this CPU lacks ") + IsaName(*out);
  if (!HasKernel(layout, *out))
    return std::string("no ") + IsaName(*out) + " kernel for layout " + LayoutName(layout);
  return "";
}

// Whether env is only [0-9]+ (no sign, space or suffix) within long long; its value in *v.
bool DigitsValue(const char* env, long long* v) {
  bool digits = *env != '\0';
  for (const char* c = env; *c; ++c) digits &= *c >= '0' && *c <= '9';
  if (!digits) return false;
  errno = 0;
  *v = std::strtoll(env, nullptr, 10);
  return errno == 0;
}

}  // namespace

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  GetPool().ParallelFor(n, fn);
}

int ThreadsFor(const char* env, unsigned hw, std::string* warning) {
  const int cap = hw == 0 ? kMaxThreadsUnknownHw : int(std::min<unsigned>(hw, 1u << 16));
  const int dflt = hw == 0 ? 1 : cap;
  if (env == nullptr || *env == '\0') return dflt;
  long long v = 0;
  if (!DigitsValue(env, &v) || v < 1) {
    *warning = std::string("LRJAX_W4A8_THREADS='") + env +
               "' is not a positive integer; using " + std::to_string(dflt) + " threads";
    return dflt;
  }
  if (v > cap) {
    *warning = std::string("LRJAX_W4A8_THREADS=") + env + " exceeds the " +
               (hw == 0 ? "default cap of " : "hardware's ") + std::to_string(cap) +
               " threads; using " + std::to_string(cap);
    return cap;
  }
  return int(v);
}

int SpinUsFor(const char* env, std::string* warning) {
  if (env == nullptr || *env == '\0') return kDefaultSpinUs;
  long long v = 0;
  if (!DigitsValue(env, &v) || v > kMaxSpinUs) {
    *warning = std::string("LRJAX_W4A8_SPIN_US='") + env + "' is not an integer from 0 to " +
               std::to_string(kMaxSpinUs) + "; spinning " + std::to_string(kDefaultSpinUs) +
               " us";
    return kDefaultSpinUs;
  }
  return int(v);
}

int NumThreads() {
  std::string warning;
  const int n = ThreadsFor(std::getenv("LRJAX_W4A8_THREADS"), std::thread::hardware_concurrency(),
                           &warning);
  static std::atomic<bool> warned{false};
  if (!warning.empty() && !warned.exchange(true))
    std::fprintf(stderr, "lrjax W4A8: %s\n", warning.c_str());
  return n;
}

// ---------------------------------------------------------------- scalar tile

namespace {

// q[k][n] in [-8, 7] from any layout.
inline int WeightAt(const TileArgs& a, int64_t k, int64_t n) {
  const int bw = BlockWidth(a.layout);
  const int64_t nb = n / bw, c = n % bw, kc = k / 8, j = k % 8;
  const uint8_t* chunk = a.packed + (nb * (a.Kp / 8) + kc) * (bw * 4);
  int u;
  if (a.layout == Layout::kArm8) {
    const int64_t h = c / 4, cc = c % 2, lo = (c % 4) / 2;
    const uint8_t b = chunk[16 * h + 8 * cc + j];
    u = lo ? (b & 15) : (b >> 4);
  } else {
    const uint8_t b = chunk[4 * c + (j % 4)];
    u = j < 4 ? (b & 15) : (b >> 4);
  }
  return u - 8;
}

}  // namespace

// Plain loops over unpacked int8 weights: the reference every ISA path must match.
// It sums xq*q directly (no +8 trick), so it also checks the kernels' correction.
void TileScalar(const TileArgs& a, int64_t m0, int mr, int64_t n0, int nc, float* acc) {
  std::vector<int8_t> col(size_t(a.Kp));
  for (int c = 0; c < nc; ++c) {
    for (int64_t k = 0; k < a.Kp; ++k) col[size_t(k)] = int8_t(WeightAt(a, k, n0 + c));
    for (int r = 0; r < mr; ++r) {
      const int8_t* x = a.xq + (m0 + r) * a.Kp;
      float f = 0.f;
      for (int64_t g = 0; g < a.G; ++g) {
        const int64_t k0 = g * a.group, k1 = std::min(k0 + a.group, a.Kp);
        int32_t s = 0;
        for (int64_t k = k0; k < k1; ++k) s += int32_t(x[k]) * int32_t(col[size_t(k)]);
        const float t = float(s) * a.scales[g * a.Np + n0 + c];
        f = f + t;
      }
      acc[r * kTileN + c] = f;
    }
  }
}

// ------------------------------------------------------------------ the GEMMs

namespace {

const float* RowF32(const void* x, DType dt, int64_t m, int64_t K, std::vector<float>& buf) {
  if (dt == DType::kF32) return static_cast<const float*>(x) + m * K;
  const uint16_t* b = static_cast<const uint16_t*>(x) + m * K;
  buf.resize(size_t(K));
  for (int64_t k = 0; k < K; ++k) buf[size_t(k)] = Bf16ToF32(b[k]);
  return buf.data();
}

// Outputs of one row that is not quantized (see w4a8.h): f32 math over the
// dequantized weights, y[n] = sum over k, in order, of x[k] * (q[k][n] * s[g][n])
// (+ bias).
void ExactRow(const float* x, const Weights& w, const float* bias, void* dst, DType dt) {
  const int64_t bw = BlockWidth(w.layout), Kp = RoundUp(w.K, 8), Np = RoundUp(w.N, bw);
  const int64_t grp = w.group == 0 ? Kp : w.group;
  TileArgs ta{nullptr, nullptr, nullptr, w.packed, w.scales, Kp, NumGroups(w.K, w.group), Np,
              grp, w.layout};
  std::vector<float> out(size_t(w.N));
  for (int64_t n = 0; n < w.N; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < w.K; ++k)
      acc = acc + x[k] * (float(WeightAt(ta, k, n)) * w.scales[(k / grp) * Np + n]);
    out[size_t(n)] = acc;
  }
  StoreRow(1.f, out.data(), bias, int(w.N), dst, dt);
}

// Rewrites the output rows whose activations were not quantized (sa is NaN).
void FixExactRows(const QAct& a, const void* x, DType x_dtype, const Weights& w,
                      const float* bias, void* y, DType y_dtype) {
  const size_t esz = y_dtype == DType::kF32 ? 4 : 2;
  std::vector<float> buf;
  for (int64_t m = 0; m < a.M; ++m)
    if (std::isnan(a.sa[size_t(m)]))
      ExactRow(RowF32(x, x_dtype, m, w.K, buf), w, bias,
                   static_cast<char*>(y) + m * w.N * esz, y_dtype);
}

}  // namespace

std::string Matmul(const void* x, DType x_dtype, int64_t M, const Weights& w, const float* bias,
                   void* y, DType y_dtype, int isa_req) {
  Isa isa;
  std::string err = CheckIsa(w.layout, isa_req, &isa);
  if (!err.empty()) return err;
  if (M == 0) return "";
  QAct a;
  QuantizeInput(x, x_dtype, M, w.K, w.group, a, isa == Isa::kI8mm);
  const size_t esz = y_dtype == DType::kF32 ? 4 : 2;
  RunGemm(a, w, isa, [&](int64_t m, int64_t n0, int n, const float* acc) {
    StoreRow(a.sa[size_t(m)], acc, bias ? bias + n0 : nullptr, n,
             static_cast<char*>(y) + (m * w.N + n0) * esz, y_dtype);
  });
  FixExactRows(a, x, x_dtype, w, bias, y, y_dtype);
  return "";
}

std::string LowRankMatmul(const void* x, DType x_dtype, int64_t M, const Weights& u,
                          const Weights& v, const float* bias, void* y, DType y_dtype,
                          int isa_req, const float* scale) {
  if (u.layout != v.layout)
    return std::string("u and v layouts differ: ") + LayoutName(u.layout) + " vs " +
           LayoutName(v.layout);
  if (u.N != v.K)
    return "rank mismatch: u is K->" + std::to_string(u.N) + ", v is " + std::to_string(v.K) +
           "->N";
  Isa isa;
  std::string err = CheckIsa(u.layout, isa_req, &isa);
  if (!err.empty()) return err;
  if (M == 0) return "";
  const bool pairs = isa == Isa::kI8mm;
  const int64_t R = u.N, Rp = RoundUp(R, 8), Gv = NumGroups(R, v.group);
  const int64_t grp_v = v.group == 0 ? Rp : v.group;
  const size_t esz = y_dtype == DType::kF32 ? 4 : 2;
  const size_t xesz = x_dtype == DType::kF32 ? 4 : 2;
  // Row blocks keep the rank-space intermediate (<= 1 MiB of f32, then int8) cache
  // resident; the block size does not change any result.
  const int64_t mb = std::max<int64_t>(8, std::min<int64_t>(M, (1 << 20) / (4 * Rp)) / 8 * 8);
  QAct a, t;
  std::vector<float> tf;
  for (int64_t m0 = 0; m0 < M; m0 += mb) {
    const int64_t rows = std::min(mb, M - m0);
    const void* xb = static_cast<const char*>(x) + m0 * u.K * xesz;
    QuantizeInput(xb, x_dtype, rows, u.K, u.group, a, pairs);
    tf.assign(size_t(rows * R), 0.f);
    RunGemm(a, u, isa, [&](int64_t m, int64_t n0, int n, const float* acc) {
      StoreRow(a.sa[size_t(m)], acc, nullptr, n, &tf[size_t(m * R + n0)], DType::kF32);
    });
    FixExactRows(a, xb, x_dtype, u, nullptr, tf.data(), DType::kF32);
    if (scale != nullptr) {  // t ⊙ scale in f32, as the unfused (x·U) * s computes it
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t j = 0; j < R; ++j) tf[size_t(m * R + j)] *= scale[j];
    }
    Prepare(t, rows, Rp, Gv, pairs);
    const int64_t qrows = 16;  // even: row pairs stay within one task
    GetPool().ParallelFor((rows + qrows - 1) / qrows, [&](int64_t task) {
      const int64_t r0 = task * qrows, r1 = std::min(rows, r0 + qrows);
      for (int64_t m = r0; m < r1; ++m) {
        int8_t* q = &t.xq[size_t(m * Rp)];
        t.sa[size_t(m)] = QuantizeRow(&tf[size_t(m * R)], R, Rp, q);
        FinishRow(q, Rp, Gv, grp_v, &t.xinit[size_t(m * Gv)]);
      }
      if (pairs) MakePairs(t, r0, r1);
    });
    char* yb = static_cast<char*>(y) + m0 * v.N * esz;
    RunGemm(t, v, isa, [&](int64_t m, int64_t n0, int n, const float* acc) {
      StoreRow(t.sa[size_t(m)], acc, bias ? bias + n0 : nullptr, n, yb + (m * v.N + n0) * esz,
               y_dtype);
    });
    FixExactRows(t, tf.data(), DType::kF32, v, bias, yb, y_dtype);
  }
  return "";
}

}  // namespace lrjax_w4a8
