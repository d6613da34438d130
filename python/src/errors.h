// gdkv._core's errors: gdkv.errors' exceptions for a failed call (its NVMe status, or why it failed
// besides: FailureKind), and the TypeError and ValueError of an argument.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "gdkv/key.h"

namespace gdkv_py {

namespace nb = nanobind;

// Why a call failed besides its NVMe status, for gdkv.errors._make (exported as failure_kinds).
enum FailureKind : int {
  kNoFailure = 0,
  kTimedOut = 1,       // ClientFailure::kTimeout
  kPeerGone = 2,       // ClientFailure::kPeerGone
  kClosed = 3,         // the client was closed
  kOpenFailed = 4,     // gdkv.open could not open the backend
  kConnectFailed = 5,  // gdkv.connect could not reach gdkvd
};

// _core._set_error_factory: gdkv.errors._make(op, key, status, failure, message) -> exception
// instance, which make_error calls; set at import.
void set_error_factory(nb::object f);

// _core.failure_kinds: FailureKind's numbers by name, which gdkv.errors._make reads (declared
// here only).
nb::dict failure_kinds();

// The gdkv.Error for a failed call (not raised).
nb::object make_error(const char* op, const gdkv::Key* key, int status, int failure,
                      const std::string& message);

[[noreturn]] void raise_error(const char* op, const gdkv::Key* key, int status, int failure,
                              const std::string& message);

[[noreturn]] void raise_type(const std::string& message);

[[noreturn]] void raise_value(const std::string& message);

std::string py_type_name(nb::handle h);

}  // namespace gdkv_py
