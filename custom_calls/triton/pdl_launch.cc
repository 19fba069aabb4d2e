// lrjax_triton_launch: an XLA FFI handler that launches a compiled Triton kernel with
// cuLaunchKernelEx, optionally as a programmatic dependent launch (PDL).
//
// jaxlib's own Triton handler launches with a plain cuLaunchKernel, so a kernel starts only
// after the kernel ahead of it on the stream has finished and flushed. With the launch
// attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION the kernel's CTAs may start
// as soon as the one ahead of it has let them (or its CTAs have exited); the kernel must then
// begin with griddepcontrol.wait before it reads anything that kernel wrote
// (custom_calls/triton/_common.py, join_chain). launch.py decides which kernels qualify.
//
// The kernel travels in the custom call itself: its PTX, entry name, shared memory and warps
// are attributes, with a content hash (key_hi, key_lo) under which the loaded function is
// cached once per CUDA context. Nothing in the compiled HLO depends on this process, so
// executables stay valid in JAX's persistent compilation cache.
//
// Parameters are (kind, a, b) triples in the kernel's parameter order:
//   kBuffer: a = index into [operands..., results...], b = bytes to zero before the launch;
//   kI32 / kI64: a = value; kF32: a = the float's bits; kNull: a null pointer (Triton's
//   profile scratch, and its global scratch where the kernel needs none);
//   kScratch: a = buffer index, b = an alignment: the buffer's address rounded up to it
//   (Triton's global scratch, where a kernel builds TMA descriptors on the device; launch.py
//   sizes the buffer with b bytes to spare).
// The CUDA driver is opened with dlopen at the first launch, so the library loads (and its
// error paths can be tested) on a machine without a GPU.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum ParamKind : int64_t { kBuffer = 0, kI32 = 1, kI64 = 2, kNull = 3, kF32 = 4,
                            kScratch = 5 };

// Each entry point at the ABI version whose prototype is used here (cudaTypedefs.h's
// PFN_<name>_v<version>): cuGetProcAddress would otherwise hand out the newest version the
// header's CUDA_VERSION knows, e.g. cuStreamGetCtx's three-argument v12050.
struct Driver {
  PFN_cuModuleLoadData_v2000 module_load_data = nullptr;
  PFN_cuModuleGetFunction_v2000 module_get_function = nullptr;
  PFN_cuFuncSetAttribute_v9000 func_set_attribute = nullptr;
  PFN_cuLaunchKernelEx_v11060 launch_kernel_ex = nullptr;
  PFN_cuStreamGetCtx_v9020 stream_get_ctx = nullptr;
  PFN_cuCtxPushCurrent_v4000 ctx_push = nullptr;
  PFN_cuCtxPopCurrent_v4000 ctx_pop = nullptr;
  PFN_cuMemsetD8Async_v3020 memset_d8_async = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  std::string error;  // why the driver is unusable; empty when it is
};

Driver LoadDriver() {
  Driver d;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    d.error = std::string("cannot open the CUDA driver (libcuda.so.1): ") + (why ? why : "?");
    return d;
  }
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(
      dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    d.error = "the CUDA driver has no cuGetProcAddress_v2 (driver older than CUDA 12.0)";
    return d;
  }
  auto resolve = [&](const char* name, int version, auto* fn) {
    void* p = nullptr;
    CUdriverProcAddressQueryResult status;
    if (get_proc(name, &p, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
        p == nullptr) {
      if (d.error.empty()) d.error = std::string("the CUDA driver has no ") + name;
      return;
    }
    *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(p);
  };
  resolve("cuModuleLoadData", 2000, &d.module_load_data);
  resolve("cuModuleGetFunction", 2000, &d.module_get_function);
  resolve("cuFuncSetAttribute", 9000, &d.func_set_attribute);
  resolve("cuLaunchKernelEx", 11060, &d.launch_kernel_ex);
  resolve("cuStreamGetCtx", 9020, &d.stream_get_ctx);
  resolve("cuCtxPushCurrent", 4000, &d.ctx_push);
  resolve("cuCtxPopCurrent", 4000, &d.ctx_pop);
  resolve("cuMemsetD8Async", 3020, &d.memset_d8_async);
  resolve("cuGetErrorString", 6000, &d.get_error_string);
  return d;
}

const Driver& GetDriver() {
  static const Driver driver = LoadDriver();
  return driver;
}

std::string CudaError(const Driver& d, CUresult r, const char* what, std::string_view name) {
  const char* s = nullptr;
  if (d.get_error_string == nullptr || d.get_error_string(r, &s) != CUDA_SUCCESS) s = nullptr;
  return std::string(what) + " failed for Triton kernel '" + std::string(name) +
         "': " + (s ? s : "CUDA error " + std::to_string(static_cast<int>(r)));
}

// Loaded functions by (content hash, context). Modules stay loaded for the process's life,
// as jaxlib's do.
std::mutex g_mu;
std::map<std::pair<std::pair<uint64_t, uint64_t>, CUcontext>, CUfunction> g_functions;

ffi::ErrorOr<CUfunction> GetFunction(const Driver& d, CUstream stream, int64_t key_hi,
                                     int64_t key_lo, std::string_view image,
                                     std::string_view name, int64_t shared) {
  CUcontext ctx = nullptr;
  if (CUresult r = d.stream_get_ctx(stream, &ctx); r != CUDA_SUCCESS) {
    return ffi::Unexpected(ffi::Error::Internal(CudaError(d, r, "cuStreamGetCtx", name)));
  }
  auto key = std::make_pair(std::make_pair(static_cast<uint64_t>(key_hi),
                                           static_cast<uint64_t>(key_lo)), ctx);
  std::lock_guard<std::mutex> lock(g_mu);
  if (auto it = g_functions.find(key); it != g_functions.end()) return it->second;
  // cuModuleLoadData wants a NUL-terminated PTX image; the attribute is not one
  std::string ptx(image);
  std::string entry(name);
  if (CUresult r = d.ctx_push(ctx); r != CUDA_SUCCESS) {
    return ffi::Unexpected(ffi::Error::Internal(CudaError(d, r, "cuCtxPushCurrent", name)));
  }
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  CUresult r = d.module_load_data(&module, ptx.c_str());
  const char* what = "cuModuleLoadData (JIT-compiling the PTX)";
  if (r == CUDA_SUCCESS) {
    what = "cuModuleGetFunction";
    r = d.module_get_function(&fn, module, entry.c_str());
  }
  if (r == CUDA_SUCCESS && shared > 48 * 1024) {  // above 48 KB a kernel must opt in
    what = "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)";
    r = d.func_set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             static_cast<int>(shared));
  }
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  if (r != CUDA_SUCCESS) {
    return ffi::Unexpected(ffi::Error::Internal(CudaError(d, r, what, name)));
  }
  g_functions.emplace(key, fn);
  return fn;
}

ffi::ErrorOr<void*> BufferAt(ffi::RemainingArgs& args, ffi::RemainingRets& rets, int64_t i) {
  if (i < 0) return ffi::Unexpected(ffi::Error::InvalidArgument("negative buffer index"));
  if (static_cast<size_t>(i) < args.size()) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return ffi::Unexpected(b.error());
    return b->untyped_data();
  }
  size_t j = static_cast<size_t>(i) - args.size();
  if (j >= rets.size()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "buffer index " + std::to_string(i) + " past the " + std::to_string(args.size()) +
        " operands and " + std::to_string(rets.size()) + " results"));
  }
  auto b = rets.get<ffi::AnyBuffer>(j);
  if (!b.has_value()) return ffi::Unexpected(b.error());
  return (*b)->untyped_data();
}

ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::string_view name, std::string_view image, int64_t key_hi,
                  int64_t key_lo, int64_t shared, int64_t num_warps,
                  ffi::Span<const int64_t> grid, ffi::Span<const int64_t> params, bool pdl) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal("lrjax_triton_launch: " + d.error);
  if (grid.size() != 3 || params.size() % 3 != 0 || num_warps < 1 || shared < 0) {
    return ffi::Error::InvalidArgument(
        "lrjax_triton_launch: expected grid = 3 dims, params = (kind, a, b) triples, "
        "num_warps >= 1 and shared >= 0");
  }
  auto fn = GetFunction(d, stream, key_hi, key_lo, image, name, shared);
  if (!fn.has_value()) return fn.error();
  size_t n = params.size() / 3;
  std::vector<uint64_t> values(n, 0);  // each parameter's bytes, little-endian
  std::vector<void*> ptrs(n);
  for (size_t p = 0; p < n; ++p) {
    int64_t kind = params[3 * p], a = params[3 * p + 1], b = params[3 * p + 2];
    switch (kind) {
      case kBuffer: {
        auto ptr = BufferAt(args, rets, a);
        if (!ptr.has_value()) return ptr.error();
        values[p] = reinterpret_cast<uint64_t>(*ptr);
        if (b > 0) {
          if (CUresult r = d.memset_d8_async(values[p], 0, static_cast<size_t>(b), stream);
              r != CUDA_SUCCESS) {
            return ffi::Error::Internal(CudaError(d, r, "cuMemsetD8Async", name));
          }
        }
        break;
      }
      case kI32: {
        int32_t v = static_cast<int32_t>(a);
        std::memcpy(&values[p], &v, sizeof(v));
        break;
      }
      case kF32: {
        uint32_t v = static_cast<uint32_t>(a);
        std::memcpy(&values[p], &v, sizeof(v));
        break;
      }
      case kI64:
        values[p] = static_cast<uint64_t>(a);
        break;
      case kNull:
        break;
      case kScratch: {
        auto ptr = BufferAt(args, rets, a);
        if (!ptr.has_value()) return ptr.error();
        if (b < 1 || (b & (b - 1)) != 0) {
          return ffi::Error::InvalidArgument("lrjax_triton_launch: scratch alignment " +
                                             std::to_string(b) + " is not a power of two");
        }
        uint64_t at = reinterpret_cast<uint64_t>(*ptr);
        values[p] = (at + static_cast<uint64_t>(b) - 1) & ~(static_cast<uint64_t>(b) - 1);
        break;
      }
      default:
        return ffi::Error::InvalidArgument("lrjax_triton_launch: parameter " +
                                           std::to_string(p) + " has unknown kind " +
                                           std::to_string(kind));
    }
    ptrs[p] = &values[p];
  }
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = static_cast<unsigned>(grid[0]);
  config.gridDimY = static_cast<unsigned>(grid[1]);
  config.gridDimZ = static_cast<unsigned>(grid[2]);
  config.blockDimX = static_cast<unsigned>(32 * num_warps);
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = static_cast<unsigned>(shared);
  config.hStream = stream;
  config.attrs = pdl ? &attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  if (config.gridDimX * config.gridDimY * config.gridDimZ == 0) return ffi::Error::Success();
  if (CUresult r = d.launch_kernel_ex(&config, *fn, ptrs.data(), nullptr); r != CUDA_SUCCESS) {
    return ffi::Error::Internal(CudaError(d, r, "cuLaunchKernelEx", name));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LrjaxTritonLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("name")   // the PTX entry
                                  .Attr<std::string_view>("image")  // PTX text
                                  .Attr<int64_t>("key_hi")          // content hash of both
                                  .Attr<int64_t>("key_lo")
                                  .Attr<int64_t>("shared")          // dynamic shared bytes
                                  .Attr<int64_t>("num_warps")
                                  .Attr<ffi::Span<const int64_t>>("grid")
                                  .Attr<ffi::Span<const int64_t>>("params")
                                  .Attr<bool>("pdl"),
                              {ffi::Traits::kCmdBufferCompatible});

// For tests and for launch.py's availability check: why the CUDA driver cannot be used
// (an empty string when it can). Opens the driver on first use.
extern "C" const char* lrjax_triton_launch_driver_error() {
  return GetDriver().error.c_str();
}
