// XLA FFI handler of the CPU decode attention (decode_attention.h), registered by the
// extension module (w4a8_ffi.cc) as "lrjax_cpu_decode_attention". Every shape and attribute
// is checked; a bad call returns ffi::Error (a Python exception), never crashes.
#include <cstdint>
#include <exception>
#include <string>

#include "decode_attention.h"
#include "ffi_dims.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using lrjax_cpu::Dims;

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos,
                               ffi::ResultBuffer<ffi::F32> out, int64_t length, int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions();
  auto od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q " + Dims(qd) + " must be [B, Hq, D]" +
                                       " and k " + Dims(kd) + " [B, Hkv, T, D]");
  const int64_t B = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[1], T = kd[2];
  if (kd[0] != B || kd[3] != D || Hkv < 1 || Hq % Hkv != 0)
    return ffi::Error::InvalidArgument("decode_attention: k " + Dims(kd) + " must be [B=" +
                                       std::to_string(B) + ", Hkv, T, D=" + std::to_string(D) +
                                       "] with Hkv dividing Hq=" + std::to_string(Hq));
  if (vd.size() != 4 || vd[0] != B || vd[1] != Hkv || vd[2] != T || vd[3] != D)
    return ffi::Error::InvalidArgument("decode_attention: v " + Dims(vd) + " must equal k's " +
                                       Dims(kd));
  if (pd.size() != 1 || pd[0] != B)
    return ffi::Error::InvalidArgument("decode_attention: pos " + Dims(pd) + " must be [B=" +
                                       std::to_string(B) + "]");
  if (od.size() != 2 || od[0] != B || od[1] != Hq * D)
    return ffi::Error::InvalidArgument("decode_attention: output " + Dims(od) + " must be [" +
                                       std::to_string(B) + ", " + std::to_string(Hq * D) + "]");
  if (length < 1 || length > T || window < 0)
    return ffi::Error::InvalidArgument("decode_attention: length=" + std::to_string(length) +
                                       " must be in [1, T=" + std::to_string(T) +
                                       "] and window=" + std::to_string(window) + " >= 0");
  try {
    lrjax_cpu::DecodeAttentionF32(q.typed_data(), k.typed_data(), v.typed_data(),
                                  pos.typed_data(), out->typed_data(), B, Hq, Hkv, T, D, length,
                                  window);
  } catch (const std::exception& ex) {  // e.g. std::bad_alloc: never unwind into XLA
    return ffi::Error::Internal(std::string("decode_attention: ") + ex.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LrjaxCpuDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [B, Hkv, T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [B, Hkv, T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, Hq * D]
                                  .Attr<int64_t>("length")      // keys at or past it: never
                                  .Attr<int64_t>("window"));    // 0: no sliding window
