// gdkv._core: the Python binding of gdkv::Client (nanobind). The public API is python/gdkv/,
// which wraps this module; see docs/python.md.
//
// Buffers: bytes-like objects (buffer protocol: bytes, bytearray, memoryview, numpy arrays) and
// DLPack objects (torch tensors, CPU or CUDA) are passed to the controller by address, never
// copied here. Through gdkvd the controller reaches only the memory shared with it (alloc(), and
// memory shared in place by register()); a buffer elsewhere is staged by the C++ client and
// counted in copies().
//
// Threads: every call releases the GIL while it waits; close() waits for calls in flight.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gdkv/backend_factory.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/commands.h"
#include "gdkv/key.h"
#include "gdkv/settings.h"
#include "gdkv/vfio_user.h"
#ifdef GDKV_HAVE_CUDA
#include "gdkv/gpu_runtime.h"
#endif

namespace nb = nanobind;
using gdkv::CmdResult;
using gdkv::Key;
using gdkv::nvme::Status;

namespace {

// Why a call failed besides its NVMe status, for gdkv.errors._make (exported as failure_kinds).
enum FailureKind : int {
  kNoFailure = 0,
  kTimedOut = 1,       // ClientFailure::kTimeout
  kPeerGone = 2,       // ClientFailure::kPeerGone
  kClosed = 3,         // the client was closed
  kOpenFailed = 4,     // gdkv.open could not open the backend
  kConnectFailed = 5,  // gdkv.connect could not reach gdkvd
};

// gdkv.errors._make(op, key, status, failure, message) -> exception instance; set at import.
// A handle that is never released: a static nb::object would be released after the interpreter
// finalized.
nb::handle g_make_error;

// The gdkv.Error for a failed call (not raised).
nb::object make_error(const char* op, const Key* key, int status, int failure,
                      const std::string& message) {
  nb::object key_obj = nb::none();
  if (key != nullptr) key_obj = nb::bytes(key->bytes, key->len);
  return g_make_error(op, key_obj, status, failure, message);
}

[[noreturn]] void raise_error(const char* op, const Key* key, int status, int failure,
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

// The bytes of a bytes object or a str (UTF-8); TypeError naming `what` otherwise.
std::string bytes_or_str(nb::handle h, const char* what) {
  if (PyBytes_Check(h.ptr()))
    return {PyBytes_AS_STRING(h.ptr()), size_t(PyBytes_GET_SIZE(h.ptr()))};
  if (PyUnicode_Check(h.ptr())) return nb::cast<std::string>(h);
  raise_type(std::string(what) + " is bytes or str, not " + py_type_name(h));
}

// bytes, bytearray or str (UTF-8) of 1..16 bytes.
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

bool c_contiguous(const nb::ndarray<>& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

// `what` names the argument in messages ("value", "out").
Buffer get_buffer_any(nb::handle obj, bool writable, const char* what);

// A buffer of at most 4 GiB - 1 (NVMe-KV sizes are 32-bit).
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

// One buffer or a list/tuple of buffers (a value laid out across them in order).
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

// Memory from alloc(): freed when the last array viewing it goes.
struct Allocation {
  std::shared_ptr<gdkv::VfioUserDevice> device;  // null: heap memory
  void* p = nullptr;
  ~Allocation() {
    if (device) {
      device->free(p);
    } else {
      std::free(p);
    }
  }
};

class PyClient {
 public:
  PyClient(std::unique_ptr<gdkv::Client> client, std::shared_ptr<gdkv::VfioUserDevice> device,
           uint32_t nsid, std::string where, bool cuda, uint32_t timeout_ms = 0)
      : client_(std::move(client)),
        device_(std::move(device)),
        remote_(device_ != nullptr),
        nsid_(nsid),
        where_(std::move(where)),
        cuda_(cuda),
        timeout_ms_(timeout_ms) {}

  // ---- single commands ----
  void put(nb::handle key, nb::handle value, bool must_exist, bool must_not_exist) {
    const Key k = to_key(key);
    if (must_exist && must_not_exist)
      raise_value("must_exist and must_not_exist exclude each other");
    Buffer v = get_buffer(value, false, "value");
    check_cuda(v);
    uint8_t opts = 0;
    if (must_exist) opts |= gdkv::nvme::kStoreMustExist;
    if (must_not_exist) opts |= gdkv::nvme::kStoreMustNotExist;
    CmdResult r = run([&](gdkv::Client& c) { return c.put(k, {v.ptr, v.len}, opts, nsid_); });
    check("put", &k, r);
  }

  // One Retrieve whatever the value's length (Client::get_value: received in memory gdkvd
  // writes in place), then the one copy a bytes object needs. `size_hint` is no longer used.
  nb::bytes get(nb::handle key, size_t /*size_hint*/) {
    const Key k = to_key(key);
    gdkv::ReceivedValue v;
    CmdResult r = run([&](gdkv::Client& c) { return c.get_value(k, v, nsid_); });
    check("get", &k, r);
    return nb::bytes(v.data(), v.size());
  }

  // The value where it was received, no copy: a read-only memoryview that owns the memory until
  // it is released (memoryview.release(), or its last reference gone).
  nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>> get_view(nb::handle key) {
    const Key k = to_key(key);
    auto v = std::make_unique<gdkv::ReceivedValue>();
    CmdResult r = run([&](gdkv::Client& c) { return c.get_value(k, *v, nsid_); });
    check("get_view", &k, r);
    return view_of(std::move(v));
  }

  uint32_t get_into(nb::handle key, nb::handle out, bool partial) {
    const Key k = to_key(key);
    std::vector<Buffer> bufs = get_buffers(out, true, "out");
    for (auto& b : bufs) check_cuda(b);
    CmdResult r;
    if (bufs.size() == 1) {
      r = run([&](gdkv::Client& c) { return c.get(k, {bufs[0].ptr, bufs[0].len}, nsid_); });
    } else {
      std::vector<gdkv::nvme::ScatterEntry> pieces = scatter_pieces(bufs);
      r = run([&](gdkv::Client& c) { return c.scatter_get(k, pieces, nsid_); });
    }
    check("get_into", &k, r);
    check_fits(k, r.dw0, bufs, partial);
    return r.dw0;
  }

  bool exists(nb::handle key) {
    const Key k = to_key(key);
    CmdResult r = run([&](gdkv::Client& c) { return c.exists(k, nsid_); });
    if (r.status == Status::kKeyNotExist) return false;
    check("exists", &k, r);
    return true;
  }

  bool remove(nb::handle key, bool missing_ok) {
    const Key k = to_key(key);
    CmdResult r = run([&](gdkv::Client& c) { return c.del(k, nsid_); });
    if (r.status == Status::kKeyNotExist && missing_ok) return false;
    check("delete", &k, r);
    return true;
  }

  std::vector<nb::bytes> list(nb::handle prefix) {
    const std::string pre = prefix.is_none() ? std::string() : bytes_or_str(prefix, "prefix");
    std::vector<Key> keys;
    CmdResult r = run([&](gdkv::Client& c) { return c.list_all(keys, nsid_); });
    check("list", nullptr, r);
    std::vector<nb::bytes> out;
    for (const Key& k : keys) {
      if (k.view().substr(0, pre.size()) == pre) out.emplace_back(k.bytes, k.len);
    }
    return out;
  }

  // A scheduler hint: these keys will be read soon, in this order (one Prefetch with the hint
  // option). Empty list or one too long: ValueError (02h); bad key: the key error.
  void hint(nb::handle keys_obj) {
    std::vector<Key> keys = to_keys(keys_obj);
    CmdResult r = run([&](gdkv::Client& c) { return c.hint(keys, nsid_); });
    check("hint", nullptr, r);
  }

  // ---- batches: one submission round for many keys, one result per key ----
  // A key whose command failed gets its gdkv.Error in its place (not raised); a failed or closed
  // client raises, as every call does.
  nb::list exists_many(nb::handle keys_obj) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<CmdResult> r;
    (void)run([&](gdkv::Client& c) {
      r = c.exists_many(keys, nsid_);
      return CmdResult{};
    });
    return per_key(
        "exists", keys, r,
        [&](size_t i) { return r[i].ok() ? Py_NewRef(Py_True) : Py_NewRef(Py_False); },
        Status::kKeyNotExist);
  }

  // (how many leading keys exist, None or the error of the key whose Exist failed and so ended
  // the run): Client::lookup_prefix's rounds of 16, 32, 64... keys.
  std::tuple<size_t, nb::object> lookup(nb::handle keys_obj) {
    std::vector<Key> keys = to_keys(keys_obj);
    CmdResult stop{};
    size_t n = 0;
    (void)run([&](gdkv::Client& c) {
      n = c.lookup_prefix(keys, nsid_, &stop);
      return CmdResult{};
    });
    if (n == keys.size() || stop.status == Status::kKeyNotExist) return {n, nb::none()};
    return {n, nb::steal(item_error("lookup_prefix", keys[n], stop))};
  }

  nb::list delete_many(nb::handle keys_obj, bool missing_ok) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<CmdResult> r;
    (void)run([&](gdkv::Client& c) {
      r = c.del_many(keys, nsid_);
      return CmdResult{};
    });
    return per_key(
        "delete_many", keys, r, [](size_t) { return Py_NewRef(Py_None); },
        missing_ok ? Status::kKeyNotExist : Status::kSuccess);
  }

  nb::list put_many(nb::handle keys_obj, nb::handle values_obj) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<Buffer> values;
    for (nb::handle h : values_obj) values.push_back(get_buffer(h, false, "value"));
    if (values.size() != keys.size()) {
      raise_value(std::to_string(keys.size()) + " keys but " + std::to_string(values.size()) +
                  " values");
    }
    std::vector<std::span<const std::byte>> spans;
    spans.reserve(values.size());
    for (auto& v : values) {
      check_cuda(v);
      spans.emplace_back(v.ptr, v.len);
    }
    std::vector<CmdResult> r;
    (void)run([&](gdkv::Client& c) {
      r = c.put_many(keys, spans, 0, nsid_);
      return CmdResult{};
    });
    return per_key("put_many", keys, r, [](size_t) { return Py_NewRef(Py_None); });
  }

  // Client::get_values: one Retrieve per key where the memory allows (see its comment). Each
  // value is copied into its bytes object as its command completes, while the controller works
  // on the later ones, and its memory given back at once; None where the key is missing.
  // `size_hint` is no longer used.
  std::vector<nb::object> get_many(nb::handle keys_obj, size_t /*size_hint*/) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<nb::object> out(keys.size(), nb::none());
    std::vector<CmdResult> results(keys.size());
    bool no_memory = false;
    (void)run([&](gdkv::Client& c) {
      c.get_values(keys, nsid_, [&](size_t i, const CmdResult& r, gdkv::ReceivedValue& v) {
        results[i] = r;
        if (!r.ok()) return;
        nb::gil_scoped_acquire gil;
        PyObject* b = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                                static_cast<Py_ssize_t>(v.size()));
        if (b == nullptr) {  // raised below, after every command completed
          PyErr_Clear();
          no_memory = true;
          return;
        }
        out[i] = nb::steal(b);
      });
      return CmdResult{};
    });
    if (no_memory) throw std::bad_alloc();
    for (size_t i = 0; i < keys.size(); ++i) {
      if (results[i].status != Status::kKeyNotExist) check("get_many", &keys[i], results[i]);
    }
    return out;
  }

  // get_many's values as get_view's read-only memoryviews (each holds its memory while it
  // lives); None where the key is missing.
  std::vector<nb::object> get_many_view(nb::handle keys_obj) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<std::unique_ptr<gdkv::ReceivedValue>> values(keys.size());
    std::vector<CmdResult> results(keys.size());
    (void)run([&](gdkv::Client& c) {
      c.get_values(keys, nsid_, [&](size_t i, const CmdResult& r, gdkv::ReceivedValue& v) {
        results[i] = r;
        if (r.ok()) values[i] = std::make_unique<gdkv::ReceivedValue>(std::move(v));
      });
      return CmdResult{};
    });
    std::vector<nb::object> out(keys.size(), nb::none());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (results[i].status == Status::kKeyNotExist) continue;
      check("get_many_view", &keys[i], results[i]);
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      if (values[i]) out[i] = nb::cast(view_of(std::move(values[i])));
    }
    return out;
  }

  // Each value's full length, or its error: KeyNotFoundError for a missing key, ValueSizeError
  // for one longer than its buffers (unless partial: then its first bytes landed).
  nb::list get_many_into(nb::handle keys_obj, nb::handle outs_obj, bool partial) {
    std::vector<Key> keys = to_keys(keys_obj);
    std::vector<std::vector<Buffer>> outs;
    for (nb::handle h : outs_obj) outs.push_back(get_buffers(h, true, "out"));
    if (outs.size() != keys.size()) {
      raise_value(std::to_string(keys.size()) + " keys but " + std::to_string(outs.size()) +
                  " outputs");
    }
    // One piece per single buffer, all in one vector; a value over several buffers has its own.
    std::vector<gdkv::nvme::ScatterEntry> single(keys.size());
    std::vector<std::vector<gdkv::nvme::ScatterEntry>> scattered(keys.size());
    std::vector<std::span<const gdkv::nvme::ScatterEntry>> pieces(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      for (auto& b : outs[i]) check_cuda(b);
      if (outs[i].size() == 1) {
        const Buffer& b = outs[i][0];
        if (b.len > UINT32_MAX) raise_value("an output past 4 GiB");
        single[i] = {reinterpret_cast<uint64_t>(b.ptr), 0, static_cast<uint32_t>(b.len)};
        pieces[i] = {&single[i], 1};
      } else {
        scattered[i] = scatter_pieces(outs[i]);
        pieces[i] = scattered[i];
      }
    }
    std::vector<CmdResult> r;
    (void)run([&](gdkv::Client& c) {
      r = c.get_many_into(keys, pieces, nsid_);
      return CmdResult{};
    });
    return per_key("get_many_into", keys, r, [&](size_t i) -> PyObject* {
      if (std::optional<std::string> too_long = fits(r[i].dw0, outs[i], partial)) {
        return make_error("get_many_into", &keys[i], static_cast<int>(Status::kInvalidValueSize),
                          kNoFailure, *too_long)
            .release()
            .ptr();
      }
      return PyLong_FromUnsignedLong(r[i].dw0);
    });
  }

  // ---- memory ----
  // `nbytes` of memory the controller reaches in place, as a numpy uint8 array.
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> alloc(size_t nbytes) {
    if (nbytes == 0) raise_value("alloc of 0 bytes");
    auto a = std::make_unique<Allocation>();
    std::shared_lock lk(mu_);
    if (!client_) raise_closed();
    if (client_->failure() != gdkv::ClientFailure::kNone) {
      lk.unlock();
      check("alloc", nullptr, CmdResult{Status::kAbortRequested, gdkv::nvme::kSctGeneric, 0});
    }
    if (device_) {
      a->device = device_;
      a->p = device_->alloc(nbytes, 4096);
      if (a->p == nullptr) {
        raise_error("alloc", nullptr, static_cast<int>(Status::kCapacityExceeded), kNoFailure,
                    "the memory shared with gdkvd has no " + std::to_string(nbytes) +
                        " bytes left (connect(shared_memory_bytes=...) sets its size)");
      }
    } else {
      a->p = std::aligned_alloc(4096, (nbytes + 4095) & ~size_t{4095});
      if (a->p == nullptr) throw std::bad_alloc();
    }
    void* p = a->p;
    nb::capsule owner(a.release(), [](void* x) noexcept { delete static_cast<Allocation*>(x); });
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p, {nbytes}, owner);
  }

  // Makes memory the caller already has reachable in place, until unregister(): a CUDA tensor by
  // the controller's copy engines (in-process with cuda_device); host memory through gdkvd
  // shared in place (VfioUserDevice::share: its pages moved onto a memfd gdkvd maps, at the same
  // addresses), and in-process as it is. The object is kept alive while registered.
  void register_memory(nb::handle obj) {
    Buffer b = get_buffer_any(obj, true, "buffer");
    if (b.len == 0) raise_value("register() of an empty buffer");
    if (!b.cuda) {
      std::shared_ptr<gdkv::VfioUserDevice> dev;
      {
        std::shared_lock lk(mu_);
        if (!client_) raise_closed();
        dev = device_;
      }
      if (dev) {
        gdkv::Result<void> r;
        {
          nb::gil_scoped_release nogil;
          r = dev->share(b.ptr, b.len);
        }
        if (!r) raise_value("register(): " + r.error());
      }
      std::lock_guard rl(reg_mu_);
      host_.emplace(reinterpret_cast<uintptr_t>(b.ptr), nb::borrow(obj));
      return;
    }
    if (!cuda_) raise_value("register() needs a client opened with cuda_device=N (a CUDA build)");
    std::shared_lock lk(mu_);
    if (!client_) raise_closed();
    if (client_->controller() == nullptr) {
      raise_value(
          "CUDA memory through gdkvd is not supported yet: open the store in-process "
          "(gdkv.open(..., cuda_device=N))");
    }
    if (!client_->controller()->register_memory(b.ptr, b.len, gdkv::MemKind::kDevice)) {
      raise_value("this memory overlaps memory registered before");
    }
    std::lock_guard rl(reg_mu_);
    registered_[reinterpret_cast<uintptr_t>(b.ptr)] = b.len;
  }
  void unregister_memory(nb::handle obj) {
    Buffer b = get_buffer_any(obj, false, "buffer");
    if (!b.cuda) {
      nb::object keep;  // released after the locks, with the GIL
      std::shared_ptr<gdkv::VfioUserDevice> dev;
      {
        std::shared_lock lk(mu_);
        if (!client_) raise_closed();
        dev = device_;
        std::lock_guard rl(reg_mu_);
        auto it = host_.find(reinterpret_cast<uintptr_t>(b.ptr));
        if (it == host_.end()) raise_value("this memory was not registered");
        keep = std::move(it->second);
        host_.erase(it);
      }
      if (dev) {
        gdkv::Result<void> r;
        {
          nb::gil_scoped_release nogil;
          r = dev->unshare(b.ptr);
        }
        if (!r) raise_value("unregister(): " + r.error());
      }
      return;
    }
    std::shared_lock lk(mu_);
    if (!client_) raise_closed();
    std::lock_guard rl(reg_mu_);
    if (registered_.erase(reinterpret_cast<uintptr_t>(b.ptr)) == 0) {
      raise_value("this memory was not registered");
    }
    (void)client_->controller()->unregister_memory(b.ptr);
  }

  // Whether the controller reads and writes `obj`'s memory in place (no staging copy).
  bool reaches(nb::handle obj) {
    Buffer b = get_buffer(obj, false, "buffer");
    if (b.cuda) return cuda_ && registered(b);
    auto dev = device();
    return !remote_ || (dev && dev->contains(b.ptr, b.len));
  }

  std::tuple<uint64_t, uint64_t> copies() {
    std::shared_lock lk(mu_);
    if (!client_) return {closed_copies_.copies, closed_copies_.bytes};
    const gdkv::CopyCounters c = client_->copies();
    return {c.copies, c.bytes};
  }

  std::vector<std::tuple<std::string, std::vector<std::tuple<std::string, std::string>>, double>>
  metrics() {
    gdkv::MetricList m;
    {
      std::shared_lock lk(mu_);
      if (!client_) raise_closed();
      if (client_->controller() != nullptr) client_->controller()->collect(m);
      const gdkv::CopyCounters c = client_->copies();
      gdkv::MetricWriter w(m);
      w.counter("client_staged_copies_total", "", static_cast<double>(c.copies));
      w.counter("client_staged_bytes_total", "", static_cast<double>(c.bytes));
    }
    std::vector<std::tuple<std::string, std::vector<std::tuple<std::string, std::string>>, double>>
        out;
    for (const auto& x : m) {
      std::vector<std::tuple<std::string, std::string>> labels(x.labels.begin(), x.labels.end());
      out.emplace_back(x.name, std::move(labels), x.value);
    }
    return out;
  }

  void close() {
    std::unique_ptr<gdkv::Client> c;
    {
      nb::gil_scoped_release nogil;
      std::unique_lock lk(mu_);  // waits for calls in flight
      if (client_) closed_copies_ = client_->copies();
      c = std::move(client_);
      c.reset();
      device_.reset();  // gdkvd lets go of memory shared in place; the process keeps it
    }
    std::multimap<uintptr_t, nb::object> held;
    {
      std::lock_guard rl(reg_mu_);
      held.swap(host_);
    }
  }
  bool closed() {
    std::shared_lock lk(mu_);
    return client_ == nullptr;
  }
  const std::string& where() const { return where_; }
  uint32_t nsid() const { return nsid_; }
  bool remote() const { return remote_; }

 private:
  [[noreturn]] void raise_closed() {
    raise_error("call", nullptr, -1, kClosed, "this client is closed (" + where_ + ")");
  }

  // Runs f(client) without the GIL; raises if the client is closed.
  template <class F>
  CmdResult run(F&& f) {
    bool closed = false;
    CmdResult r{};
    {
      nb::gil_scoped_release nogil;
      std::shared_lock lk(mu_);
      if (client_) {
        r = f(*client_);
      } else {
        closed = true;
      }
    }
    if (closed) raise_closed();
    return r;
  }

  void check(const char* op, const Key* k, const CmdResult& r) {
    if (r.ok()) return;
    nb::object e = error_of(op, k, r);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
    throw nb::python_error();
  }

  // The error of one key's failed command in a batch (a new reference); a failed client raises.
  PyObject* item_error(const char* op, const Key& k, const CmdResult& r) {
    if (r.status == Status::kAbortRequested && failed()) check(op, &k, r);
    return error_of(op, &k, r).release().ptr();
  }

  // The list of a batch's results: ok(i) (a new reference) for a key whose command succeeded
  // or ended with `also_ok` (87h where a missing key is an answer), else the key's error.
  template <class Ok>
  nb::list per_key(const char* op, const std::vector<Key>& keys, const std::vector<CmdResult>& r,
                   Ok ok, Status also_ok = Status::kSuccess) {
    nb::list out = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(keys.size())));
    for (size_t i = 0; i < keys.size(); ++i) {
      PyObject* o = r[i].ok() || r[i].status == also_ok ? ok(i) : item_error(op, keys[i], r[i]);
      if (o == nullptr) throw nb::python_error();
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), o);
    }
    return out;
  }

  bool failed() {
    std::shared_lock lk(mu_);
    return !client_ || client_->failure() != gdkv::ClientFailure::kNone;
  }

  // The gdkv.Error for a failed command: TimeoutError or ConnectionError once the client failed.
  nb::object error_of(const char* op, const Key* k, const CmdResult& r) {
    gdkv::ClientFailure f = gdkv::ClientFailure::kNone;
    if (r.status == Status::kAbortRequested) {
      std::shared_lock lk(mu_);
      if (client_) f = client_->failure();
    }
    if (f == gdkv::ClientFailure::kTimeout) {
      return make_error(op, k, -1, kTimedOut,
                        where_ + " did not complete the command within " +
                            std::to_string(timeout_ms_) +
                            " ms; this client is unusable, connect again");
    }
    if (f == gdkv::ClientFailure::kPeerGone) {
      return make_error(op, k, -1, kPeerGone,
                        where_ + " closed the connection (exited or died); connect again");
    }
    std::string msg = gdkv::describe(r);
    const std::string_view o(op);
    const bool receives = o == "get" || o == "get_view" || o == "get_many" || o == "get_many_view";
    if (r.status == gdkv::kStagingExhausted && device() && receives) {
      msg +=
          ": the memory shared with gdkvd has no room to receive this value "
          "(connect(shared_memory_bytes=...) sets its size; views returned by get_view hold "
          "theirs until released)";
    } else if (r.status == gdkv::kStagingExhausted && device()) {
      msg +=
          ": the store is full, or the memory shared with gdkvd has no room to stage this "
          "buffer (connect(shared_memory_bytes=...), or use client.empty() buffers)";
    }
    return make_error(op, k, static_cast<int>(r.status), kNoFailure, msg);
  }

  void check_fits(const Key& k, uint32_t value_len, const std::vector<Buffer>& bufs, bool partial) {
    if (auto m = fits(value_len, bufs, partial)) {
      raise_error("get_into", &k, static_cast<int>(Status::kInvalidValueSize), kNoFailure, *m);
    }
  }
  // Why a value of `value_len` bytes does not fit `bufs` (nullopt: it does, or partial).
  static std::optional<std::string> fits(uint32_t value_len, const std::vector<Buffer>& bufs,
                                         bool partial) {
    size_t total = 0;
    for (const auto& b : bufs) total += b.len;
    if (partial || value_len <= total) return std::nullopt;
    return "the value has " + std::to_string(value_len) + " bytes, the buffer " +
           std::to_string(total) +
           " (only its first bytes were written; partial=True accepts that)";
  }

  // CUDA memory needs a client whose controller has CUDA copy engines, and registration (the
  // controller must know device memory as such; it would take an unknown address for host memory).
  void check_cuda(const Buffer& b) {
    if (!b.cuda) return;
    if (!cuda_) {
      raise_value(
          "a CUDA tensor needs a client with CUDA copy engines: gdkv.open(..., "
          "cuda_device=N) in a CUDA build");
    }
    if (!registered(b))
      raise_value("CUDA memory must be registered first: client.register(tensor)");
  }
  bool registered(const Buffer& b) {
    std::lock_guard lk(reg_mu_);
    auto it = registered_.upper_bound(reinterpret_cast<uintptr_t>(b.ptr));
    return it != registered_.begin() && reinterpret_cast<uintptr_t>(b.ptr) + b.len <=
                                            std::prev(it)->first + std::prev(it)->second;
  }

  // Pieces of a value laid out across `bufs` in order. Through gdkvd they must be shared memory.
  std::vector<gdkv::nvme::ScatterEntry> scatter_pieces(const std::vector<Buffer>& bufs) {
    if (bufs.size() > gdkv::nvme::kMaxScatterEntries) {
      raise_value("at most " + std::to_string(gdkv::nvme::kMaxScatterEntries) +
                  " buffers take one value");
    }
    std::vector<gdkv::nvme::ScatterEntry> pieces;
    uint64_t off = 0;
    auto dev = device();
    for (const auto& b : bufs) {
      if (dev && !b.cuda && !dev->contains(b.ptr, b.len)) {
        raise_value(
            "through gdkvd, a value spread over several buffers lands in place only: "
            "each buffer must come from client.empty()/alloc()");
      }
      if (b.len > UINT32_MAX || off > UINT32_MAX) raise_value("a piece past 4 GiB");
      pieces.push_back({reinterpret_cast<uint64_t>(b.ptr), static_cast<uint32_t>(off),
                        static_cast<uint32_t>(b.len)});
      off += b.len;
    }
    return pieces;
  }

  // A read-only memoryview of a received value that owns it: the memory goes back when the
  // view is released.
  static nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>> view_of(
      std::unique_ptr<gdkv::ReceivedValue> v) {
    static const uint8_t kNothing = 0;  // a 0-byte value may have no memory
    const uint8_t* p =
        v->data() != nullptr ? reinterpret_cast<const uint8_t*>(v->data()) : &kNothing;
    const size_t n = v->size();
    nb::capsule owner(v.release(),
                      [](void* x) noexcept { delete static_cast<gdkv::ReceivedValue*>(x); });
    return nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>>(p, {n}, owner);
  }

  // The connection, while open (close() drops it): read it through device().
  std::shared_ptr<gdkv::VfioUserDevice> device() {
    std::shared_lock lk(mu_);
    return device_;
  }

  std::shared_mutex mu_;
  std::unique_ptr<gdkv::Client> client_;
  std::shared_ptr<gdkv::VfioUserDevice> device_;
  bool remote_;
  uint32_t nsid_;
  std::string where_;
  bool cuda_;
  uint32_t timeout_ms_;
  gdkv::CopyCounters closed_copies_;
  std::mutex reg_mu_;
  std::map<uintptr_t, size_t> registered_;     // CUDA memory: address -> bytes
  std::multimap<uintptr_t, nb::object> host_;  // host memory registered: address -> the buffer
};

// Settings by name, name -> value, applied to a default T through `table` (gdkv/settings.h;
// None keeps the default): an unknown name or a value of the wrong type raises TypeError, a value
// out of range ValueError.
template <class T>
T to_settings(const std::vector<gdkv::Setting<T>>& table, const nb::dict& given) {
  T s;
  for (auto [k, v] : given) {
    const std::string name = nb::cast<std::string>(k);
    const gdkv::Setting<T>* x = gdkv::find_setting(table, name);
    if (x == nullptr) raise_type("unknown setting '" + name + "' (gdkv.settings() lists them)");
    if (v.is_none()) continue;
    gdkv::SettingValue value;
    switch (x->type) {
      case gdkv::SettingInfo::Type::kBool:
        if (!PyBool_Check(v.ptr())) raise_type(name + " is a bool, not " + py_type_name(v));
        value = v.ptr() == Py_True;
        break;
      case gdkv::SettingInfo::Type::kString:
        if (!PyUnicode_Check(v.ptr())) raise_type(name + " is a str, not " + py_type_name(v));
        value = nb::cast<std::string>(v);
        break;
      default: {
        if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) {
          raise_type(name + " is an int, not " + py_type_name(v));
        }
        const long long n = PyLong_AsLongLong(v.ptr());
        if (n == -1 && PyErr_Occurred()) {
          PyErr_Clear();  // past 64 bits
          raise_value(name + ": " + x->range_error());
        }
        value = int64_t{n};
      }
    }
    if (const std::string err = x->set(s, value); !err.empty()) raise_value(name + ": " + err);
  }
  return s;
}

// A setting's value as Python holds it.
nb::object setting_value(const gdkv::SettingValue& v) {
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) return nb::int_(*n);
  if (const int64_t* n = std::get_if<int64_t>(&v)) return nb::int_(*n);
  if (const bool* b = std::get_if<bool>(&v)) return nb::bool_(*b);
  return nb::str(std::get<std::string>(v).c_str());
}

// Every row's value once `given` is applied to the defaults, as gdkv.open or gdkv.connect would
// open with them; refuses what they refuse, with their errors.
template <class T>
nb::dict effective(const std::vector<gdkv::Setting<T>>& table, const nb::dict& given) {
  const T s = to_settings(table, given);
  nb::dict out;
  for (const gdkv::Setting<T>& x : table) out[x.name] = setting_value(x.get(s));
  return out;
}

// The rows of `table` as dicts, each with its default (a default T's value) and `kind`.
template <class T>
void describe(const std::vector<gdkv::Setting<T>>& table, const char* kind, nb::list& out) {
  const T defaults;
  for (const gdkv::Setting<T>& x : table) {
    nb::dict d;
    d["name"] = x.name;
    d["kind"] = kind;
    d["toml"] = x.toml;
    d["flag"] = x.flag;
    d["default"] = setting_value(x.get(defaults));
    if (x.is_integer()) {
      d["type"] = "int";
      d["min"] = x.min;
      d["max"] = x.max;
    } else if (x.type == gdkv::SettingInfo::Type::kBool) {
      d["type"] = "bool";
    } else {
      d["type"] = "str";
      d["choices"] = x.choices;
    }
    d["unit"] = x.unit;
    d["help"] = x.help;
    out.append(d);
  }
}

// _core.effective_settings(given, kind): see effective(); kind "store" (gdkv.open's) or
// "client" (gdkv.connect's).
nb::dict effective_settings(const nb::dict& given, const std::string& kind) {
  if (kind == "client") return effective(gdkv::client_settings(), given);
  if (kind != "store") raise_value("kind is store or client, not '" + kind + "'");
  return effective(gdkv::store_settings(), given);
}

// gdkv.backend_traits(): each registered backend's traits (gdkv/backend_registry.h), by name.
nb::dict backend_traits() {
  nb::dict out;
  for (const gdkv::BackendRegistration& b : gdkv::backend_registry()) {
    nb::dict d;
    d["help"] = b.help;
    d["can_time_out"] = b.traits.can_time_out;
    d["needs_directory"] = b.traits.needs_directory;
    d["directory_setting"] = b.directory_setting;
    d["can_be_far_tier"] = b.traits.can_be_far_tier;
    d["needs_cluster"] = b.traits.needs_cluster;
    d["has_far_tier"] = b.traits.has_far_tier;
    out[b.name.c_str()] = d;
  }
  return out;
}

// gdkv.settings(): every table, the store's, a client's and gdkvd's, each row a dict.
nb::list settings_table() {
  nb::list out;
  describe(gdkv::store_settings(), "store", out);
  describe(gdkv::client_settings(), "client", out);
  describe(gdkv::daemon_settings(), "daemon", out);
  return out;
}

std::unique_ptr<PyClient> open_in_process(const nb::dict& settings, uint32_t nsid,
                                          uint32_t queue_depth, int cuda_device) {
  gdkv::StoreSettings o = to_settings(gdkv::store_settings(), settings);
  gdkv::ClientOptions co;
  co.controller = o.controller;
  co.controller.namespaces = nsid;
  co.queue.depth = queue_depth;
  const bool cuda = cuda_device >= 0;
  if (cuda) {
#ifdef GDKV_HAVE_CUDA
    gdkv::gpu::GpuOptions g;
    g.device = cuda_device;
    co.controller = gdkv::gpu::controller_options(co.controller, g);
    o.cache = gdkv::gpu::cache_options(o.cache);
#else
    raise_value("cuda_device: this gdkv was built without CUDA (nvcc not found at build time)");
#endif
  }
  const gdkv::BackendConfig& bc = o.backend;
  std::string where =
      bc.kind == "local"
          ? "local store at " + (bc.local.path.empty() ? gdkv::default_store_dir() : bc.local.path)
          : bc.kind + " backend";
  std::unique_ptr<gdkv::Client> c;
  std::string error;
  {
    nb::gil_scoped_release nogil;
    auto backend = gdkv::open_store(o);
    if (backend) {
      auto opened = gdkv::Client::open(*backend, co);
      if (opened) {
        c = std::move(*opened);
      } else {
        error = opened.error();
      }
    } else {
      error = backend.error();
    }
  }
  if (!c) raise_error("open", nullptr, -1, kOpenFailed, error);
  return std::make_unique<PyClient>(std::move(c), nullptr, nsid, where, cuda);
}

std::unique_ptr<PyClient> connect(const std::string& socket_dir, const nb::dict& settings,
                                  uint32_t nsid) {
  gdkv::VfioUserClientOptions vo = to_settings(gdkv::client_settings(), settings);
  // Bring-up and teardown wait no longer than one command may (at most admin_timeout_ms).
  if (vo.timeout_ms > 0) vo.admin_timeout_ms = std::min(vo.timeout_ms, vo.admin_timeout_ms);
  std::shared_ptr<gdkv::VfioUserDevice> dev;
  std::unique_ptr<gdkv::Client> c;
  std::string error;
  {
    nb::gil_scoped_release nogil;
    auto opened = gdkv::VfioUserDevice::open(socket_dir, vo);
    if (opened) {
      dev = *opened;
      auto client = dev->make_client();
      if (client) {
        c = std::move(*client);
      } else {
        error = client.error();
      }
    } else {
      error = opened.error();
    }
  }
  if (!c) raise_error("connect", nullptr, -1, kConnectFailed, error);
  return std::make_unique<PyClient>(std::move(c), std::move(dev), nsid, "gdkvd at " + socket_dir,
                                    false, vo.timeout_ms);
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

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "gdkv's C++ client (use the gdkv package, not this module)";
  m.def("_set_error_factory", [](nb::object f) { g_make_error = f.release(); });
  // FailureKind's numbers, which gdkv.errors._make reads (declared here only).
  nb::dict kinds;
  kinds["timed_out"] = int(kTimedOut);
  kinds["peer_gone"] = int(kPeerGone);
  kinds["closed"] = int(kClosed);
  kinds["open_failed"] = int(kOpenFailed);
  kinds["connect_failed"] = int(kConnectFailed);
  m.attr("failure_kinds") = kinds;
  m.attr("max_key_bytes") = gdkv::nvme::kMaxKeyLength;
#ifdef GDKV_HAVE_CUDA
  m.attr("cuda_build") = true;
#else
  m.attr("cuda_build") = false;
#endif
  m.def("backends", &gdkv::available_backends);
  m.def("backend_traits", &backend_traits);

  m.def("settings", &settings_table);
  m.def("effective_settings", &effective_settings, nb::arg("given"), nb::arg("kind") = "store");

  nb::class_<PyClient>(m, "Core")
      .def("put", &PyClient::put, nb::arg("key"), nb::arg("value"), nb::arg("must_exist"),
           nb::arg("must_not_exist"))
      .def("get", &PyClient::get, nb::arg("key"), nb::arg("size_hint"))
      .def("get_view", &PyClient::get_view, nb::arg("key"))
      .def("get_into", &PyClient::get_into, nb::arg("key"), nb::arg("out"), nb::arg("partial"))
      .def("exists", &PyClient::exists, nb::arg("key"))
      .def("delete", &PyClient::remove, nb::arg("key"), nb::arg("missing_ok"))
      .def("list", &PyClient::list, nb::arg("prefix").none())
      .def("exists_many", &PyClient::exists_many, nb::arg("keys"))
      .def("lookup", &PyClient::lookup, nb::arg("keys"))
      .def("hint", &PyClient::hint, nb::arg("keys"))
      .def("delete_many", &PyClient::delete_many, nb::arg("keys"), nb::arg("missing_ok"))
      .def("put_many", &PyClient::put_many, nb::arg("keys"), nb::arg("values"))
      .def("get_many", &PyClient::get_many, nb::arg("keys"), nb::arg("size_hint"))
      .def("get_many_view", &PyClient::get_many_view, nb::arg("keys"))
      .def("get_many_into", &PyClient::get_many_into, nb::arg("keys"), nb::arg("outs"),
           nb::arg("partial"))
      .def("alloc", &PyClient::alloc, nb::arg("nbytes"))
      .def("reaches", &PyClient::reaches, nb::arg("buffer"))
      .def("register", &PyClient::register_memory, nb::arg("tensor"))
      .def("unregister", &PyClient::unregister_memory, nb::arg("tensor"))
      .def("copies", &PyClient::copies)
      .def("metrics", &PyClient::metrics)
      .def("close", &PyClient::close)
      .def_prop_ro("closed", &PyClient::closed)
      .def_prop_ro("where", &PyClient::where)
      .def_prop_ro("nsid", &PyClient::nsid)
      .def_prop_ro("remote", &PyClient::remote);

  m.def("open", &open_in_process, nb::arg("settings"), nb::arg("nsid"), nb::arg("queue_depth"),
        nb::arg("cuda_device"));
  m.def("connect", &connect, nb::arg("socket_dir"), nb::arg("settings"), nb::arg("nsid"));
  m.def(
      "chain_keys",
      [](nb::handle tokens, size_t block_tokens, nb::handle salt, nb::handle parent) {
        if (block_tokens == 0) raise_value("block_tokens must be > 0");
        std::vector<uint32_t> t = to_tokens(tokens);
        const std::string s = bytes_or_str(salt, "salt");
        std::optional<Key> p;
        if (!parent.is_none()) p = to_key(parent);
        std::vector<Key> keys = gdkv::chain_keys(t, block_tokens, s, p ? &*p : nullptr);
        std::vector<nb::bytes> out;
        out.reserve(keys.size());
        for (const Key& k : keys) out.emplace_back(k.bytes, k.len);
        return out;
      },
      nb::arg("tokens"), nb::arg("block_tokens"), nb::arg("salt"), nb::arg("parent").none());
  m.def(
      "prepare_shared_memory",
      [](nb::handle obj) {
        Buffer b = get_buffer_any(obj, true, "buffer");
        if (b.cuda) raise_value("prepare_shared_memory takes host memory");
        if (b.len == 0) raise_value("prepare_shared_memory of an empty buffer");
        gdkv::Result<void> r;
        {
          nb::gil_scoped_release nogil;
          r = gdkv::prepare_shared_memory(b.ptr, b.len);
        }
        if (!r) raise_value("prepare_shared_memory(): " + r.error());
      },
      nb::arg("buffer"));
  m.def(
      "hash128",
      [](nb::handle data) {
        Buffer b = get_buffer(data, false, "data");
        if (b.cuda) raise_value("hash128 reads host memory");
        const Key k = gdkv::hash128(b.ptr, b.len);
        return nb::bytes(k.bytes, k.len);
      },
      nb::arg("data"));
}
