// How opening things reports failure: one error model for the whole API.
//
// Everything that opens or starts something (a backend: open_backend, make_local_backend,
// make_rados_backend, make_tiered_backend; the cache: make_cached_backend; a queue pair:
// Controller::create_queue, Client::open, a device's make_client(); the vfio-user server's
// start() and a device's open(); the metrics server's start()) returns a Result: the thing, or an
// Error whose message names what failed and why ("rados: cannot open pool 'x' (config ..., client
// ...): No such file or directory"). None of them throws for such a failure. value() on an error
// throws std::runtime_error with that message, like std::expected's value(): a caller that
// prefers an exception (a test, a program's main) asks for it at its call site.
//
// Requests on what is open (Store, Retrieve, ...) report NVMe statuses (nvme::Status), never
// exceptions; precondition violations (REQUIRES in the headers) are bugs, not errors.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace gdkv {

struct Error {
  std::string message;
};

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}              // NOLINT: implicit, as std::expected's
  Result(Error error) : error_(std::move(error.message)) {}  // NOLINT

  bool ok() const noexcept { return value_.has_value(); }
  explicit operator bool() const noexcept { return ok(); }
  // REQUIRES: !ok().
  const std::string& error() const noexcept { return error_; }

  // The value; throws std::runtime_error(error()) when there is none.
  T& value() & {
    check();
    return *value_;
  }
  const T& value() const& {
    check();
    return *value_;
  }
  T&& value() && {
    check();
    return std::move(*value_);
  }
  // REQUIRES: ok(). For a pointer-like T (shared_ptr, unique_ptr), r->f() calls the pointee's f.
  T& operator*() noexcept { return *value_; }
  decltype(auto) operator->() noexcept {
    if constexpr (requires(T & t) { t.operator->(); }) {
      return (*value_);
    } else {
      return &*value_;
    }
  }

 private:
  void check() const {
    if (!value_) throw std::runtime_error(error_);
  }
  std::optional<T> value_;
  std::string error_;
};

// Success or an Error, for what opens nothing it hands back (a server's start()).
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : failed_(true), error_(std::move(error.message)) {}  // NOLINT
  bool ok() const noexcept { return !failed_; }
  explicit operator bool() const noexcept { return ok(); }
  const std::string& error() const noexcept { return error_; }
  // Throws std::runtime_error(error()) on an error.
  void value() const {
    if (failed_) throw std::runtime_error(error_);
  }

 private:
  bool failed_ = false;
  std::string error_;
};

// Runs `f` (which may throw while it opens something) and turns an exception into an Error: the
// boundary where the library's internals meet the API.
template <class F>
auto catch_error(F&& f) -> Result<decltype(f())> {
  try {
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      return {};
    } else {
      return f();
    }
  } catch (const std::exception& e) {
    return Error{e.what()};
  }
}

}  // namespace gdkv
