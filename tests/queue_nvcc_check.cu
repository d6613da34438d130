// Compile check: the queue protocol, wire format and SQE builders build as device code under nvcc
// (sm_90). Nothing here runs; the GPU tests in src/gpu exercise the same code on a GPU.
#include "gdkv/commands.h"
#include "gdkv/nvme_kv.h"
#include "gdkv/queue.h"

namespace {

__global__ void queue_round_trip(gdkv::QueueRef q, const uint8_t* keys, void* out, uint32_t len,
                                 gdkv::CmdResult* results) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  uint16_t cid;
  while (!gdkv::queue::try_acquire(q, &cid)) gdkv::queue::reap(q);
  gdkv::nvme::Sqe s =
      gdkv::cmd::retrieve(keys + 16 * i, 16, static_cast<char*>(out) + i * len, len);
  s.cid = cid;
  gdkv::queue::submit(q, &s, 1);
  results[i] = gdkv::queue::wait(q, cid);
}

}  // namespace

void gdkv_queue_nvcc_check_launch(gdkv::QueueRef q, const uint8_t* keys, void* out, uint32_t len,
                                  gdkv::CmdResult* results) {
  queue_round_trip<<<1, 32>>>(q, keys, out, len, results);
}
