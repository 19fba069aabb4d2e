// XLA FFI handler of the CPU prefill attention (attention.h), registered by the extension
// module (w4a8_ffi.cc) as "lrjax_cpu_attention". Every shape is checked; a bad call returns
// ffi::Error (a Python exception), never crashes.
#include <cstdint>
#include <exception>
#include <string>

#include "attention.h"
#include "ffi_dims.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using lrjax_cpu::Dims;

ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::U8> mask,
                         ffi::ResultBuffer<ffi::F32> out, bool heads_first) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  auto od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4)
    return ffi::Error::InvalidArgument("attention: q " + Dims(qd) + " must be [B, S, Hq, D] and k " +
                                       Dims(kd) + " rank 4");
  const int64_t B = qd[0], S = qd[1], Hq = qd[2], D = qd[3];
  const int64_t T = heads_first ? kd[2] : kd[1], Hkv = heads_first ? kd[1] : kd[2];
  if (kd[0] != B || kd[3] != D || Hkv < 1 || Hq % Hkv != 0)
    return ffi::Error::InvalidArgument("attention: k " + Dims(kd) + " must have B=" +
                                       std::to_string(B) + ", D=" + std::to_string(D) +
                                       " and a KV head count dividing Hq=" + std::to_string(Hq));
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3])
    return ffi::Error::InvalidArgument("attention: v " + Dims(vd) + " must equal k's " +
                                       Dims(kd));
  if (md.size() != 3 || md[0] != B || md[1] != S || md[2] != T)
    return ffi::Error::InvalidArgument("attention: mask " + Dims(md) + " must be [" +
                                       std::to_string(B) + ", " + std::to_string(S) + ", " +
                                       std::to_string(T) + "]");
  if (od.size() != 3 || od[0] != B || od[1] != S || od[2] != Hq * D)
    return ffi::Error::InvalidArgument("attention: output " + Dims(od) + " must be [" +
                                       std::to_string(B) + ", " + std::to_string(S) + ", " +
                                       std::to_string(Hq * D) + "]");
  if (T < 1)
    return ffi::Error::InvalidArgument("attention: k " + Dims(kd) + " has no keys");
  try {
    lrjax_cpu::AttentionF32(q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(),
                            out->typed_data(), B, S, Hq, Hkv, T, D, heads_first);
  } catch (const std::exception& ex) {  // e.g. std::bad_alloc: never unwind into XLA
    return ffi::Error::Internal(std::string("attention: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LrjaxCpuAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, S, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [B, T, Hkv, D] or [B, Hkv, T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v, as k
                                  .Arg<ffi::Buffer<ffi::U8>>()   // mask [B, S, T], 0 or 1
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, S, Hq * D]
                                  .Attr<bool>("heads_first"));
