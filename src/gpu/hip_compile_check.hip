// Compile check of the device API for AMD GPUs (hipcc): every device.cuh function instantiated in
// a kernel. Built as an object only (ctest gpu_hip_compile_check); nothing here runs.
#include <hip/hip_runtime.h>

#include "gdkv/device.cuh"

namespace {

__global__ void every_device_function(gdkv::QueueRef q, const gdkv::Key* keys, std::byte* buf,
                                      gdkv::CmdResult* out) {
  using namespace gdkv;
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  const Key& k = keys[i];
  std::byte* slot = buf + i * 4096;
  CmdResult r[12];
  r[0] = device::put(q, k, slot, 4096);
  r[1] = device::get(q, k, slot, 4096);
  r[2] = device::exists(q, k);
  r[3] = device::del(q, k);
  r[4] = device::warp_put(q, k, slot, 4096, i % 3 != 0);
  r[5] = device::warp_get(q, k, slot, 4096);
  r[6] = device::warp_exists(q, k);
  r[7] = device::warp_del(q, k, true, 2);
  if (i % 2) {
    r[7] = device::warp_exists(q, k, true, 1, 0xAAAAAAAAAAAAAAAAull);  // one branch's lanes
  }
  r[8] = device::execute(q, device::make_list(k, slot, 4096));
  r[9] = device::warp_execute(q, device::make_scatter_retrieve(k, slot, 4096));
  uint16_t cid = 0;
  if (device::try_submit(q, device::make_prefetch(slot, 64), &cid)) {
    while (!device::poll(q, cid)) {
    }
    r[10] = device::wait(q, cid);
  }
  r[11] = device::wait(q, device::submit(q, device::make_exist(k)));
  for (int j = 0; j < 12; ++j) out[i * 12 + j] = r[j];
}

}  // namespace

void launch_every_device_function(gdkv::QueueRef q, const gdkv::Key* keys, std::byte* buf,
                                  gdkv::CmdResult* out) {
  hipLaunchKernelGGL(every_device_function, dim3(1), dim3(64), 0, 0, q, keys, buf, out);
}
