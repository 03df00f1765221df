// CUDA events recorded on the stream that runs a JAX program, for event-timed benchmarks of jitted functions.
//
// An XLA FFI custom call (HmRecordEvent, attribute "slot") records event `slot` on the stream XLA gives it; a jitted
// call of it before and after the timed call puts the two events around that call's device work, in stream order,
// as torch.cuda.Event / triton's do_bench do for PyTorch. hm_elapsed_ms(a, b) waits for event b and returns the ms
// between the two. The CUDA driver library is opened at run time, so building needs only the XLA FFI headers
// (jax.ffi.include_dir()) and a C++17 compiler: experiments/cuda_events.py builds and loads this file.

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using CUresult = int;
using CUevent = void*;
using CUstream = void*;
using CUcontext = void*;

struct Driver {
  CUresult (*event_create)(CUevent*, unsigned int) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*event_synchronize)(CUevent) = nullptr;
  CUresult (*event_elapsed)(float*, CUevent, CUevent) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  bool ok = false;
};

template <typename F>
bool Resolve(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) return d;
    d.ok = Resolve(lib, "cuEventCreate", &d.event_create) && Resolve(lib, "cuEventRecord", &d.event_record) &&
           Resolve(lib, "cuEventSynchronize", &d.event_synchronize) &&
           Resolve(lib, "cuEventElapsedTime", &d.event_elapsed) &&
           Resolve(lib, "cuCtxGetCurrent", &d.ctx_get_current) && Resolve(lib, "cuCtxPushCurrent_v2", &d.ctx_push) &&
           Resolve(lib, "cuCtxPopCurrent_v2", &d.ctx_pop);
    return d;
  }();
  return driver;
}

std::mutex events_mutex;
std::vector<CUevent> events;  // by slot, created on first record (with timing: flags 0)
CUcontext events_context = nullptr;

ffi::Error RecordImpl(void* stream, ffi::Result<ffi::BufferR0<ffi::S32>> unused, int64_t slot) {
  const Driver& cu = GetDriver();
  if (!cu.ok) return ffi::Error(ffi::ErrorCode::kUnavailable, "libcuda.so.1 or one of its event functions missing");
  if (slot < 0 || slot >= (1 << 20)) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "slot out of [0, 2^20)");
  std::lock_guard<std::mutex> lock(events_mutex);
  if (events_context == nullptr && cu.ctx_get_current(&events_context) != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal, "cuCtxGetCurrent failed");
  }
  if (static_cast<size_t>(slot) >= events.size()) events.resize(slot + 1, nullptr);
  if (events[slot] == nullptr && cu.event_create(&events[slot], 0) != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal, "cuEventCreate failed for slot " + std::to_string(slot));
  }
  if (cu.event_record(events[slot], stream) != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal, "cuEventRecord failed for slot " + std::to_string(slot));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HmRecordEvent, RecordImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("slot"));

// Milliseconds from event `start` to event `end` (waiting for `end`); negative when either was never recorded (-1)
// or a driver call failed (-2).
extern "C" float hm_elapsed_ms(int start, int end) {
  const Driver& cu = GetDriver();
  std::lock_guard<std::mutex> lock(events_mutex);
  const int size = static_cast<int>(events.size());
  if (!cu.ok || start < 0 || end < 0 || start >= size || end >= size || !events[start] || !events[end]) return -1.f;
  float ms = -2.f;
  CUcontext popped = nullptr;
  if (cu.ctx_push(events_context) != 0) return -2.f;
  if (cu.event_synchronize(events[end]) != 0 || cu.event_elapsed(&ms, events[start], events[end]) != 0) ms = -2.f;
  cu.ctx_pop(&popped);
  return ms;
}
