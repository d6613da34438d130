// gdkv._core's keys from Python: to_key and the other conversions keys.h declares.
#include "keys.h"

#include <nanobind/stl/string.h>

#include "errors.h"
#include "gdkv/nvme_kv.h"

namespace gdkv_py {

using gdkv::Key;
using gdkv::nvme::Status;

std::string bytes_or_str(nb::handle h, const char* what) {
  if (PyBytes_Check(h.ptr()))
    return {PyBytes_AS_STRING(h.ptr()), size_t(PyBytes_GET_SIZE(h.ptr()))};
  if (PyUnicode_Check(h.ptr())) return nb::cast<std::string>(h);
  raise_type(std::string(what) + " is bytes or str, not " + py_type_name(h));
}

Key to_key(nb::handle h) {
  const char* data = nullptr;
  Py_ssize_t n = 0;
  if (PyBytes_Check(h.ptr())) {
    data = PyBytes_AS_STRING(h.ptr());
    n = PyBytes_GET_SIZE(h.ptr());
  } else if (PyByteArray_Check(h.ptr())) {
    data = PyByteArray_AS_STRING(h.ptr());
    n = PyByteArray_GET_SIZE(h.ptr());
  } else if (PyUnicode_Check(h.ptr())) {
    data = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
    if (data == nullptr) throw nb::python_error();
  } else {
    raise_type("a key is bytes or str, not " + py_type_name(h));
  }
  if (n < 1 || n > static_cast<Py_ssize_t>(gdkv::nvme::kMaxKeyLength)) {
    raise_error("key", nullptr, static_cast<int>(Status::kInvalidKeySize), kNoFailure,
                "a key has 1 to 16 bytes, this one " + std::to_string(n));
  }
  return Key::from_bytes(data, static_cast<size_t>(n));
}

std::vector<Key> to_keys(nb::handle seq) {
  std::vector<Key> keys;
  for (nb::handle h : seq) keys.push_back(to_key(h));
  return keys;
}

std::vector<uint32_t> to_tokens(nb::handle tokens) {
  std::vector<uint32_t> out;
  for (nb::handle h : tokens) {
    long long v = PyLong_AsLongLong(h.ptr());
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      raise_type("token ids are ints, not " + py_type_name(h));
    }
    if (v < 0 || v > static_cast<long long>(UINT32_MAX)) {
      raise_value("a token id is in [0, 2**32), not " + std::to_string(v));
    }
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

}  // namespace gdkv_py
