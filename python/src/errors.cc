// gdkv._core's errors: gdkv.errors' exceptions made through the factory it sets at import, and
// the standard TypeError and ValueError.
#include "errors.h"

#include <nanobind/stl/string.h>

namespace gdkv_py {
namespace {

// A handle that is never released: a static nb::object would be released after the interpreter
// finalized.
nb::handle g_make_error;

}  // namespace

void set_error_factory(nb::object f) { g_make_error = f.release(); }

nb::dict failure_kinds() {
  nb::dict kinds;
  kinds["timed_out"] = int(kTimedOut);
  kinds["peer_gone"] = int(kPeerGone);
  kinds["closed"] = int(kClosed);
  kinds["open_failed"] = int(kOpenFailed);
  kinds["connect_failed"] = int(kConnectFailed);
  return kinds;
}

nb::object make_error(const char* op, const gdkv::Key* key, int status, int failure,
                      const std::string& message) {
  nb::object key_obj = nb::none();
  if (key != nullptr) key_obj = nb::bytes(key->bytes, key->len);
  return g_make_error(op, key_obj, status, failure, message);
}

[[noreturn]] void raise_error(const char* op, const gdkv::Key* key, int status, int failure,
                              const std::string& message) {
  nb::object e = make_error(op, key, status, failure, message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
  throw nb::python_error();
}

[[noreturn]] void raise_type(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw nb::python_error();
}

[[noreturn]] void raise_value(const std::string& message) {
  PyErr_SetString(PyExc_ValueError, message.c_str());
  throw nb::python_error();
}

std::string py_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

}  // namespace gdkv_py
