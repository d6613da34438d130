// gdkv._core's buffers: the buffer protocol and DLPack exports behind get_buffer_any.
#include "buffers.h"

#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "errors.h"

namespace gdkv_py {
namespace {

bool c_contiguous(const nb::ndarray<>& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

}  // namespace

Buffer get_buffer(nb::handle obj, bool writable, const char* what) {
  Buffer b = get_buffer_any(obj, writable, what);
  if (b.len > UINT32_MAX) raise_value(std::string(what) + " is larger than 4 GiB - 1 bytes");
  return b;
}

Buffer get_buffer_any(nb::handle obj, bool writable, const char* what) {
  Buffer b;
  if (PyObject_CheckBuffer(obj.ptr())) {
    const int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &b.view, flags) != 0) {
      PyErr_Clear();
      if (writable && PyObject_GetBuffer(obj.ptr(), &b.view, PyBUF_STRIDES) == 0) {
        PyBuffer_Release(&b.view);
        raise_type(std::string(what) + " must be writable; this " + py_type_name(obj) +
                   " is read-only");
      }
      PyErr_Clear();
      raise_type(std::string(what) + ": " + py_type_name(obj) + " does not export its memory");
    }
    b.has_view = true;
    if (!PyBuffer_IsContiguous(&b.view, 'C')) {
      raise_value(std::string(what) + " must be C-contiguous (its bytes are read or written in " +
                  "place); pass a contiguous copy");
    }
    b.ptr = static_cast<std::byte*>(b.view.buf);
    b.len = static_cast<size_t>(b.view.len);
    return b;
  }
  if (PyObject_HasAttrString(obj.ptr(), "__dlpack__")) {
    nb::ndarray<> a;
    if (!nb::try_cast(obj, a, /*convert=*/false)) {
      raise_type(std::string(what) + ": this " + py_type_name(obj) +
                 " cannot be exported through DLPack");
    }
    if (!c_contiguous(a)) {
      raise_value(std::string(what) + " must be contiguous (its bytes are read or written in " +
                  "place); pass .contiguous()");
    }
    const int dev = a.device_type();
    if (dev != nb::device::cpu::value && dev != nb::device::cuda::value &&
        dev != nb::device::cuda_host::value) {
      raise_value(std::string(what) + ": memory of DLPack device type " + std::to_string(dev) +
                  " is not supported (CPU and CUDA are)");
    }
    b.cuda = dev == nb::device::cuda::value;
    b.ptr = static_cast<std::byte*>(a.data());
    b.len = a.nbytes();
    b.keep = nb::cast(a);
    return b;
  }
  raise_type(std::string(what) + " must be a bytes-like object, a numpy array or a tensor, not " +
             py_type_name(obj));
}

std::vector<Buffer> get_buffers(nb::handle obj, bool writable, const char* what) {
  std::vector<Buffer> out;
  if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    for (nb::handle h : obj) out.push_back(get_buffer(h, writable, what));
    if (out.empty()) raise_value(std::string(what) + ": an empty list of buffers");
  } else {
    out.push_back(get_buffer(obj, writable, what));
  }
  return out;
}

}  // namespace gdkv_py
