// Test-only shim: lets a CPU-only build of torch trace (and run autograd over) *fake* CUDA tensors.
//
// What a CPU-only build lacks, and what fills in for it here:
//  1. A CUDA device guard. Autograd asks the guard for a tensor's stream the moment it records a node on a
//     CUDA tensor; without one it throws where no exception may pass, so the process aborts
//     ("PyTorch is not linked with support for cuda devices" -> std::terminate). (A CUDA build of torch
//     on a machine with no GPU gets a no-op guard from FakeTensorMode: c10::impl::ensureCUDADeviceGuardSet.)
//     FakeCudaGuard: devices 0..n-1, one default stream each, events accepted and ignored.
//  2. An accelerator. The autograd engine syncs streams of tensors on "the" accelerator
//     (at::accelerator::getAccelerator), which a CPU-only build does not have: backward fails with
//     "Cannot access accelerator device when none is available". FakeCUDAHooks says CUDA is built (not
//     available: torch.cuda.is_available() stays False) and that no device has a primary context.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstring>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

thread_local DeviceIndex current_device = 0;

struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  explicit FakeCudaGuard(DeviceIndex n) : n_(n) {}
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, current_device);
    if (d.has_index()) current_device = d.index();
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current_device); }
  void setDevice(Device d) const override { if (d.has_index()) current_device = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { if (d.has_index()) current_device = d.index(); }
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, index(d)); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, index(d)); }
  Stream getNewStream(Device d, int /*priority*/) const override { return Stream(Stream::DEFAULT, index(d)); }
  Stream exchangeStream(Stream s) const noexcept override { return Stream(Stream::DEFAULT, s.device()); }
  DeviceIndex deviceCount() const noexcept override { return n_; }
  void record(void** /*event*/, const Stream& /*stream*/, const DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const Stream& /*stream*/) const override {}

 private:
  static Device index(Device d) { return Device(DeviceType::CUDA, d.has_index() ? d.index() : current_device); }
  DeviceIndex n_;
};

struct FakeCUDAHooks : public at::CUDAHooksInterface {
  FakeCUDAHooks() = default;
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return false; }
};
}  // namespace

// The device guard. 1: registered; 0: a CUDA guard exists (a CUDA build of torch): left alone.
extern "C" int spmd_fake_cuda_register_guard(int device_count) {
  if (c10::impl::hasDeviceGuardImpl(DeviceType::CUDA)) return 0;
  // leaked on purpose: the registry never frees its guards
  c10::impl::registerDeviceGuard(DeviceType::CUDA, new FakeCudaGuard(static_cast<DeviceIndex>(device_count)));
  return 1;
}

// The hooks, the supported way: must run before anything asks for them (before `import torch`).
// 1: registered; 0: torch has its own (a CUDA build).
extern "C" int spmd_fake_cuda_register_hooks() {
  if (at::CUDAHooksRegistry()->Has("CUDAHooks")) return 0;
  at::CUDAHooksRegistry()->Register("CUDAHooks", [](at::CUDAHooksArgs a) -> std::unique_ptr<at::CUDAHooksInterface> {
    return std::make_unique<FakeCUDAHooks>(a);
  });
  return 1;
}

// The hooks after `import torch` made the default (empty) ones: turn that object into a FakeCUDAHooks
// by giving it FakeCUDAHooks's vtable (same layout: neither has data). A hack, for one process only.
// 1: done; 0: CUDA already "built"; -1: did not take.
extern "C" int spmd_fake_cuda_patch_hooks() {
  static_assert(sizeof(FakeCUDAHooks) == sizeof(at::CUDAHooksInterface), "hooks layout");
  auto& hooks = const_cast<at::CUDAHooksInterface&>(at::detail::getCUDAHooks());
  if (hooks.isBuilt()) return 0;
  static FakeCUDAHooks fake;
  std::memcpy(static_cast<void*>(&hooks), static_cast<const void*>(&fake), sizeof(void*));
  return at::detail::getCUDAHooks().isBuilt() ? 1 : -1;
}

extern "C" int spmd_fake_cuda_hooks_built() { return at::detail::getCUDAHooks().isBuilt() ? 1 : 0; }
