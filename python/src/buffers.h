// gdkv._core's buffers: a caller's bytes-like object or tensor as an address and a length
// (Buffer), held for one call.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace gdkv_py {

namespace nb = nanobind;

// A caller's buffer, held (exported) for the duration of one call. Destroy with the GIL held.
struct Buffer {
  std::byte* ptr = nullptr;
  size_t len = 0;
  bool cuda = false;  // device memory (DLPack device type CUDA)
  Py_buffer view{};
  bool has_view = false;
  nb::object keep;  // the DLPack import, kept alive

  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept
      : ptr(o.ptr),
        len(o.len),
        cuda(o.cuda),
        view(o.view),
        has_view(o.has_view),
        keep(std::move(o.keep)) {
    o.has_view = false;
  }
  ~Buffer() {
    if (has_view) PyBuffer_Release(&view);
  }
};

// Bytes-like objects (buffer protocol: bytes, bytearray, memoryview, numpy arrays) and DLPack
// objects (torch tensors, CPU or CUDA) are passed to the controller by address, never copied
// here. Through gdkvd the controller reaches only the memory shared with it (alloc(), and memory
// shared in place by register()); a buffer elsewhere is staged by the C++ client and counted in
// copies(). `what` names the argument in messages ("value", "out").
Buffer get_buffer_any(nb::handle obj, bool writable, const char* what);

// A buffer of at most 4 GiB - 1 (NVMe-KV sizes are 32-bit).
Buffer get_buffer(nb::handle obj, bool writable, const char* what);

// One buffer or a list/tuple of buffers (a value laid out across them in order).
std::vector<Buffer> get_buffers(nb::handle obj, bool writable, const char* what);

}  // namespace gdkv_py
