// XLA FFI handlers for the W4A8 GEMM and the quantized low-rank X·U·V, and the
// nanobind module `lrjax.custom_calls.cpu._w4a8` that exposes them
// (follows jax's examples/ffi). Every buffer shape is checked; a bad call
// returns ffi::Error (a Python exception), never crashes.
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "attention.h"
#include "decode_attention.h"
#include "ffi_dims.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/optional.h"
#include "nanobind/stl/string.h"
#include "w4a8.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;
using namespace lrjax_w4a8;

namespace {

using lrjax_cpu::Dims;

ffi::Error FloatType(ffi::DataType t, const char* name, DType* out) {
  if (t == ffi::DataType::F32) {
    *out = DType::kF32;
  } else if (t == ffi::DataType::BF16) {
    *out = DType::kBF16;
  } else {
    return ffi::Error::InvalidArgument(std::string(name) + " must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// Checks x [..., K] and y [..., N]; returns M = prod(leading dims).
ffi::Error CheckActivations(ffi::AnyBuffer x, int64_t K, ffi::Result<ffi::AnyBuffer>& y,
                            int64_t N, int64_t* M) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || xd.back() != K)
    return ffi::Error::InvalidArgument("x shape " + Dims(xd) + " must be [..., K=" +
                                       std::to_string(K) + "]");
  bool ok = yd.size() == xd.size() && yd.back() == N;
  for (size_t i = 0; ok && i + 1 < xd.size(); ++i) ok = yd[i] == xd[i];
  if (!ok)
    return ffi::Error::InvalidArgument("output shape " + Dims(yd) + " must be x's leading dims " +
                                       Dims(xd) + " with last dim N=" + std::to_string(N));
  *M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) *M *= xd[i];
  return ffi::Error::Success();
}

#define LRJAX_RETURN_IF_ERROR(expr)     \
  do {                                  \
    ffi::Error _e = (expr);             \
    if (_e.failure()) return _e;        \
  } while (0)

// Every int64 attribute is range-checked before it is narrowed or used.
constexpr int64_t kMaxDim = (int64_t(1) << 31) - 1;

ffi::Error CheckAttr(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    return ffi::Error::InvalidArgument(std::string("attribute ") + name + "=" + std::to_string(v) +
                                       " is outside [" + std::to_string(lo) + ", " +
                                       std::to_string(hi) + "]");
  return ffi::Error::Success();
}

ffi::Error MakeWeights(const char* name, const char* group_attr, ffi::Buffer<ffi::U8> w,
                       ffi::Buffer<ffi::F32> s, int64_t K, int64_t N, int64_t group,
                       int64_t layout, Weights* out) {
  auto wd = w.dimensions();
  auto sd = s.dimensions();
  if (wd.size() != 3 || sd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": packed weight " + Dims(wd) +
                                       " must be 3-D and scales " + Dims(sd) + " 2-D");
  LRJAX_RETURN_IF_ERROR(CheckAttr("layout", layout, 0, 2));  // lrjax_w4a8::Layout
  LRJAX_RETURN_IF_ERROR(CheckAttr(group_attr, group, 0, kMaxDim));
  *out = Weights{w.typed_data(), s.typed_data(), K, N, group, Layout(int(layout))};
  std::string e = CheckWeights(*out, wd[0], wd[1], wd[2], sd[0], sd[1]);
  if (!e.empty()) return ffi::Error::InvalidArgument(std::string(name) + ": " + e);
  return ffi::Error::Success();
}

// An optional f32 vector: [N], or [0] for none (out: null).
ffi::Error CheckBias(ffi::Buffer<ffi::F32> bias, int64_t N, const float** out,
                     const char* what = "bias") {
  auto bd = bias.dimensions();
  if (bd.size() != 1 || (bd[0] != 0 && bd[0] != N))
    return ffi::Error::InvalidArgument(std::string(what) + " shape " + Dims(bd) + " must be (" +
                                       std::to_string(N) + ",) or (0,) for none");
  *out = bd[0] == 0 ? nullptr : bias.typed_data();
  return ffi::Error::Success();
}

ffi::Error W4A8MatmulImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y, int64_t k,
                          int64_t n, int64_t group, int64_t layout) {
  DType xt, yt;
  LRJAX_RETURN_IF_ERROR(CheckAttr("k", k, 1, kMaxDim));
  LRJAX_RETURN_IF_ERROR(CheckAttr("n", n, 1, kMaxDim));
  LRJAX_RETURN_IF_ERROR(FloatType(x.element_type(), "x", &xt));
  LRJAX_RETURN_IF_ERROR(FloatType(y->element_type(), "output", &yt));
  const int64_t K = k;
  int64_t M;
  LRJAX_RETURN_IF_ERROR(CheckActivations(x, K, y, n, &M));
  Weights wt;
  LRJAX_RETURN_IF_ERROR(MakeWeights("w", "group", w, scales, K, n, group, layout, &wt));
  const float* b;
  LRJAX_RETURN_IF_ERROR(CheckBias(bias, n, &b));
  std::string e;
  try {
    e = Matmul(x.untyped_data(), xt, M, wt, b, y->untyped_data(), yt);
  } catch (const std::exception& ex) {  // e.g. std::bad_alloc: never unwind into XLA
    return ffi::Error::Internal(std::string("w4a8_matmul: ") + ex.what());
  }
  if (!e.empty()) return ffi::Error::InvalidArgument(e);
  return ffi::Error::Success();
}

ffi::Error LowRankW4A8Impl(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> wu, ffi::Buffer<ffi::F32> su,
                           ffi::Buffer<ffi::U8> wv, ffi::Buffer<ffi::F32> sv,
                           ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> scale,
                           ffi::Result<ffi::AnyBuffer> y, int64_t k, int64_t r, int64_t n,
                           int64_t group_u, int64_t group_v, int64_t layout) {
  DType xt, yt;
  LRJAX_RETURN_IF_ERROR(CheckAttr("k", k, 1, kMaxDim));
  LRJAX_RETURN_IF_ERROR(CheckAttr("r", r, 1, kMaxDim));
  LRJAX_RETURN_IF_ERROR(CheckAttr("n", n, 1, kMaxDim));
  LRJAX_RETURN_IF_ERROR(FloatType(x.element_type(), "x", &xt));
  LRJAX_RETURN_IF_ERROR(FloatType(y->element_type(), "output", &yt));
  const int64_t K = k;
  int64_t M;
  LRJAX_RETURN_IF_ERROR(CheckActivations(x, K, y, n, &M));
  Weights u, v;
  LRJAX_RETURN_IF_ERROR(MakeWeights("u", "group_u", wu, su, K, r, group_u, layout, &u));
  LRJAX_RETURN_IF_ERROR(MakeWeights("v", "group_v", wv, sv, r, n, group_v, layout, &v));
  const float* b;
  LRJAX_RETURN_IF_ERROR(CheckBias(bias, n, &b));
  const float* sc;
  LRJAX_RETURN_IF_ERROR(CheckBias(scale, r, &sc, "rank-space scale"));
  std::string e;
  try {
    e = LowRankMatmul(x.untyped_data(), xt, M, u, v, b, y->untyped_data(), yt, -1, sc);
  } catch (const std::exception& ex) {  // e.g. std::bad_alloc: never unwind into XLA
    return ffi::Error::Internal(std::string("lr_xuv_w4a8: ") + ex.what());
  }
  if (!e.empty()) return ffi::Error::InvalidArgument(e);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LrjaxW4A8Matmul, W4A8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // x [..., K] f32|bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w packed [Np/BW, Kp/8, 4 BW]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [G, Np]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>()       // y [..., N] f32|bf16
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("group")      // 0: per channel
                                  .Attr<int64_t>("layout"));   // lrjax_w4a8::Layout

XLA_FFI_DEFINE_HANDLER_SYMBOL(LrjaxW4A8Xuv, LowRankW4A8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()       // x [..., K] f32|bf16
                                  .Arg<ffi::Buffer<ffi::U8>>()   // u packed [Rp/BW, Kp/8, 4 BW]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // u scales [Gu, Rp]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v packed [Np/BW, Rp/8, 4 BW]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales [Gv, Np]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [N] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [r] or [0]
                                  .Ret<ffi::AnyBuffer>()       // y [..., N] f32|bf16
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("r")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("group_u")
                                  .Attr<int64_t>("group_v")
                                  .Attr<int64_t>("layout"));

// decode_attention_ffi.cc, attention_ffi.cc
extern "C" XLA_FFI_Error* LrjaxCpuDecodeAttention(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* LrjaxCpuAttention(XLA_FFI_CallFrame* call_frame);

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_w4a8, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["lrjax_w4a8_matmul"] = EncapsulateFfiHandler(LrjaxW4A8Matmul);
    d["lrjax_w4a8_xuv"] = EncapsulateFfiHandler(LrjaxW4A8Xuv);
    d["lrjax_cpu_decode_attention"] = EncapsulateFfiHandler(LrjaxCpuDecodeAttention);
    d["lrjax_cpu_attention"] = EncapsulateFfiHandler(LrjaxCpuAttention);
    return d;
  });
  m.def("cpu_isas", []() {
    nb::list out;
    const unsigned mask = CpuIsaMask();
    for (int i = 0; i <= int(Isa::kI8mm); ++i)
      if (mask >> i & 1) out.append(std::string(IsaName(Isa(i))));
    return out;
  }, "ISAs this CPU supports.");
  m.def("selected_isa", [](int layout) {
    if (layout < 0 || layout > 2) throw nb::value_error("layout must be 0, 1 or 2");
    return std::string(IsaName(SelectIsa(Layout(layout))));
  }, nb::arg("layout"), "ISA the kernel uses for a layout (honours LRJAX_W4A8_ISA).");
  m.def("prefill_attention_isa", []() { return std::string(lrjax_cpu::AttentionIsa()); },
        "The prefill attention's body (honours LRJAX_W4A8_ISA).");
  m.def("attention_isa", [](int64_t d) { return std::string(lrjax_cpu::DecodeAttentionIsa(d)); },
        nb::arg("d"), "The decode attention's body for head dim d (honours LRJAX_W4A8_ISA).");
  m.def("num_threads", &NumThreads, "Worker threads (LRJAX_W4A8_THREADS, capped).");
  m.def("threads_for", [](std::optional<std::string> env, unsigned hw) {
    std::string warning;
    const int n = ThreadsFor(env ? env->c_str() : nullptr, hw, &warning);
    return nb::make_tuple(n, warning);
  }, nb::arg("env").none(), nb::arg("hw"),
     "(threads, warning) for an LRJAX_W4A8_THREADS value on a CPU with hw threads.");
  m.def("spin_us_for", [](std::optional<std::string> env) {
    std::string warning;
    const int us = SpinUsFor(env ? env->c_str() : nullptr, &warning);
    return nb::make_tuple(us, warning);
  }, nb::arg("env").none(), "(microseconds, warning) for an LRJAX_W4A8_SPIN_US value.");
}
