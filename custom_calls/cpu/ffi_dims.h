// A buffer's shape as Python prints a tuple, for the FFI handlers' error messages.
#pragma once
#include <string>

#include "xla/ffi/api/ffi.h"

namespace lrjax_cpu {

inline std::string Dims(xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

}  // namespace lrjax_cpu
