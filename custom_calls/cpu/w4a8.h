// W4A8 GEMM for CPUs: int4 weights, int8 activations quantized per row, int32
// accumulation. Plain C++ API (no XLA dependency); w4a8_ffi.cc wraps it.
//
// Weights. q[k][n] in [-8, 7], stored as the unsigned nibble u = q + 8 (the
// paper's "int4 to uint4" trick: no subtraction in the inner loop; the +8 bias
// is removed once per row and group through -8 * sum(xq over the group)).
// Padding (k >= K or n >= N) stores u = 8 (q = 0). Kp = roundup(K, 8),
// Np = roundup(N, BW). Packed array: [Np/BW, Kp/8, BW*4] bytes, one chunk of
// 8 k x BW columns per (block nb, chunk kc); k0 = 8 kc, n0 = BW nb.
//   kX86 (BW 16) and kArm4 (BW 4; sdot, pack 4): byte 4c+j, c < BW, j < 4:
//     lo nibble = u[k0+j][n0+c], hi nibble = u[k0+4+j][n0+c]
//   kArm8 (BW 8; smmla, pack 8): byte 16h+8cc+j, h,cc < 2, j < 8:
//     hi nibble = u[k0+j][n0+4h+cc], lo nibble = u[k0+j][n0+4h+2+cc]
// Scales: [G, Np] f32, G = ceil(K/group) (group % 8 == 0), or G = 1 with
// group = 0 (per channel). Group G spans k in [G*group, min((G+1)*group, Kp)).
//
// Activations, per row m: amax = max|x|, inv = amax > 0 ? 127/amax : 0,
// xq = clamp(nearbyint(x*inv), -127, 127), sa = amax/127.
// Output: acc[m][n] = sum over groups, in order, of
//   float(sum_{k in G} xq[m][k]*q[k][n]) * s[G][n]   (f32 mul then add)
// y = acc*sa (+ bias[n], f32 add), rounded to the output dtype (RNE for bf16).
// Rows that are not quantized: a row holding a NaN or an inf, or one with
// 0 < amax < 2^-96 (kMinRowAmax; 127/amax or sa would leave the normal f32
// range), is computed in f32 over the dequantized weights instead:
//   y[n] = sum over k, in order, of x[k] * (q[k][n] * s[G][n])  (+ bias[n]).
// So NaN and inf propagate as f32 math does: NaN when the row has a NaN, when
// infs of both signs meet or when an inf meets a zero weight, else +-inf. In the
// low-rank X·U·V the rank-space row follows the same rule.
// Every ISA path performs the same float operations in the same order, so all
// paths are bit-identical to the scalar path. Worker threads run under the
// calling thread's floating-point environment (e.g. XLA's flush-to-zero), so the
// result never depends on which thread computed a tile.
#ifndef LRJAX_W4A8_H_
#define LRJAX_W4A8_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace lrjax_w4a8 {

enum class Layout : int { kX86 = 0, kArm4 = 1, kArm8 = 2 };
enum class Isa : int {
  kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3,  // x86
  kNeon = 4, kDotprod = 5, kI8mm = 6,                      // aarch64
};
enum class DType : int { kF32 = 0, kBF16 = 1 };

int BlockWidth(Layout layout);  // BW: columns per packed block
const char* IsaName(Isa isa);
const char* LayoutName(Layout layout);
// ISAs this CPU supports, as a bitmask of (1 << Isa).
unsigned CpuIsaMask();
// Best ISA for a layout on this CPU, capped by env LRJAX_W4A8_ISA (an IsaName)
// when set; an ISA the CPU lacks, or one without a kernel for the layout, is
// skipped.
Isa SelectIsa(Layout layout);
// Whether this CPU has `isa` and LRJAX_W4A8_ISA does not cap the kernels below it (the
// attention kernels' choice of body).
bool IsaAllowed(Isa isa);
// Kernel ISAs available for a layout in this build (scalar always).
bool HasKernel(Layout layout, Isa isa);

struct Weights {
  const uint8_t* packed;  // [Np/BW, Kp/8, BW*4]
  const float* scales;    // [G, Np]
  int64_t K, N;           // logical sizes
  int64_t group;          // 0 = per channel
  Layout layout;
};

constexpr float kMinRowAmax = 0x1p-96f;  // see "Rows that are not quantized"

inline int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
int64_t NumGroups(int64_t K, int64_t group);
// Shape checks shared by the FFI handlers and the tests; "" when fine.
std::string CheckWeights(const Weights& w, int64_t packed_d0, int64_t packed_d1,
                         int64_t packed_d2, int64_t scales_d0, int64_t scales_d1);

// y [M, N] = w4a8(x [M, K]) (+ bias [N], may be null). x is f32 or bf16 (as
// uint16 bits), y f32 or bf16. isa = -1: SelectIsa. Returns "" or an error.
std::string Matmul(const void* x, DType x_dtype, int64_t M, const Weights& w,
                   const float* bias, void* y, DType y_dtype, int isa = -1);

// y [M, N] = w4a8((w4a8(x, U) as f32) ⊙ scale, re-quantized per row to int8, V) (+ bias).
// U: K -> R, V: R -> N; both must use the same layout. scale: [R] f32 multiplied into each
// row of the f32 intermediate before its re-quantization, or null for none.
std::string LowRankMatmul(const void* x, DType x_dtype, int64_t M, const Weights& u,
                          const Weights& v, const float* bias, void* y, DType y_dtype,
                          int isa = -1, const float* scale = nullptr);

// Number of worker threads: env LRJAX_W4A8_THREADS (a positive integer, capped
// at the hardware threads), default: hardware threads. A malformed value is
// ignored with a one-line warning on stderr.
int NumThreads();
// Runs fn(0..n-1) on the kernels' thread pool, the caller working too (w4a8.cc: Pool): each
// index once; inline when the pool is busy with another call.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);
// The thread count for env value `env` (null: unset) on a CPU with `hw`
// hardware threads (0: unknown); sets *warning when the value is malformed or
// capped. Pure, for the tests.
int ThreadsFor(const char* env, unsigned hw, std::string* warning);
constexpr int kMaxThreadsUnknownHw = 64;  // cap when the hardware count is unknown
// Microseconds the pool's threads spin, after a task, for the next one before sleeping: env
// LRJAX_W4A8_SPIN_US (an integer from 0, sleep at once, to kMaxSpinUs), default
// kDefaultSpinUs. A malformed value gives the default and sets *warning. Pure, for the tests.
constexpr int kDefaultSpinUs = 200;
constexpr int kMaxSpinUs = 1000000;
int SpinUsFor(const char* env, std::string* warning);

// --- internal: the per-ISA tile kernels ---------------------------------------
struct TileArgs {
  const int8_t* xq;       // [Mp, Kp] row-major quantized activations
  const int8_t* xpairs;   // [Mp/2, Kp/8, 16] row pairs (kI8mm only)
  const int32_t* xinit;   // [Mp, G]: -8 * sum of xq over each group
  const uint8_t* packed;  // weights, see above
  const float* scales;    // [G, Np]
  int64_t Kp, G, Np, group;  // group in k (Kp for per channel)
  Layout layout;
};
// Computes acc (see above) for rows [m0, m0+mr) and columns [n0, n0+nc),
// n0 % BW == 0, mr <= kTileM, nc <= kTileN; acc is [mr][kTileN] row-major.
constexpr int kTileM = 8;
constexpr int kTileN = 64;
using TileFn = void (*)(const TileArgs& a, int64_t m0, int mr, int64_t n0, int nc, float* acc);
struct Tile {
  TileFn fn;  // null when the build lacks this (layout, isa)
  int mr, nc;  // preferred tile for M > 1
  int mr1, nc1;  // preferred tile for M == 1
};
Tile GetTile(Layout layout, Isa isa);

// Kernels, one translation unit per ISA (compiled with that ISA's flags).
void TileScalar(const TileArgs&, int64_t, int, int64_t, int, float*);  // any layout
void TileX86Avx512Vnni(const TileArgs&, int64_t, int, int64_t, int, float*);
void TileX86AvxVnni(const TileArgs&, int64_t, int, int64_t, int, float*);
void TileX86Avx2(const TileArgs&, int64_t, int, int64_t, int, float*);
void TileArm4Neon(const TileArgs&, int64_t, int, int64_t, int, float*);
void TileArm4Dotprod(const TileArgs&, int64_t, int, int64_t, int, float*);
void TileArm8I8mm(const TileArgs&, int64_t, int, int64_t, int, float*);

}  // namespace lrjax_w4a8

#endif  // LRJAX_W4A8_H_
