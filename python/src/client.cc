// gdkv._core's Core: PyClient's calls, each over one or many keys, and the memory it allocates
// and registers.
#include "client.h"

#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "errors.h"
#include "gdkv/metrics.h"
#include "gdkv/nvme_kv.h"
#include "keys.h"

namespace gdkv_py {

using gdkv::CmdResult;
using gdkv::Key;
using gdkv::nvme::Status;

namespace {

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

// Why a value of `value_len` bytes does not fit `bufs` (nullopt: it does, or partial).
std::optional<std::string> fits(uint32_t value_len, const std::vector<Buffer>& bufs, bool partial) {
  size_t total = 0;
  for (const auto& b : bufs) total += b.len;
  if (partial || value_len <= total) return std::nullopt;
  return "the value has " + std::to_string(value_len) + " bytes, the buffer " +
         std::to_string(total) + " (only its first bytes were written; partial=True accepts that)";
}

// A read-only memoryview of a received value that owns it: the memory goes back when the
// view is released.
nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>> view_of(
    std::unique_ptr<gdkv::ReceivedValue> v) {
  static const uint8_t kNothing = 0;  // a 0-byte value may have no memory
  const uint8_t* p = v->data() != nullptr ? reinterpret_cast<const uint8_t*>(v->data()) : &kNothing;
  const size_t n = v->size();
  nb::capsule owner(v.release(),
                    [](void* x) noexcept { delete static_cast<gdkv::ReceivedValue*>(x); });
  return nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>>(p, {n}, owner);
}

}  // namespace

void PyClient::put(nb::handle key, nb::handle value, bool must_exist, bool must_not_exist,
                   bool low_priority) {
  const Key k = to_key(key);
  if (must_exist && must_not_exist) raise_value("must_exist and must_not_exist exclude each other");
  Buffer v = get_buffer(value, false, "value");
  check_cuda(v);
  uint8_t opts = 0;
  if (must_exist) opts |= gdkv::nvme::kStoreMustExist;
  if (must_not_exist) opts |= gdkv::nvme::kStoreMustNotExist;
  if (low_priority) opts |= gdkv::nvme::kStoreLowPriority;
  CmdResult r = run([&](gdkv::Client& c) { return c.put(k, {v.ptr, v.len}, opts, nsid_); });
  check("put", &k, r);
}

nb::bytes PyClient::get(nb::handle key, size_t /*size_hint*/) {
  const Key k = to_key(key);
  gdkv::ReceivedValue v;
  CmdResult r = run([&](gdkv::Client& c) { return c.get_value(k, v, nsid_); });
  check("get", &k, r);
  return nb::bytes(v.data(), v.size());
}

nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>> PyClient::get_view(nb::handle key) {
  const Key k = to_key(key);
  auto v = std::make_unique<gdkv::ReceivedValue>();
  CmdResult r = run([&](gdkv::Client& c) { return c.get_value(k, *v, nsid_); });
  check("get_view", &k, r);
  return view_of(std::move(v));
}

uint32_t PyClient::get_into(nb::handle key, nb::handle out, bool partial) {
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

bool PyClient::exists(nb::handle key) {
  const Key k = to_key(key);
  CmdResult r = run([&](gdkv::Client& c) { return c.exists(k, nsid_); });
  if (r.status == Status::kKeyNotExist) return false;
  check("exists", &k, r);
  return true;
}

bool PyClient::remove(nb::handle key, bool missing_ok) {
  const Key k = to_key(key);
  CmdResult r = run([&](gdkv::Client& c) { return c.del(k, nsid_); });
  if (r.status == Status::kKeyNotExist && missing_ok) return false;
  check("delete", &k, r);
  return true;
}

std::vector<nb::bytes> PyClient::list(nb::handle prefix) {
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

void PyClient::hint(nb::handle keys_obj) {
  std::vector<Key> keys = to_keys(keys_obj);
  CmdResult r = run([&](gdkv::Client& c) { return c.hint(keys, nsid_); });
  check("hint", nullptr, r);
}

std::tuple<uint64_t, uint64_t, bool, bool, nb::list> PyClient::removed(
    std::optional<uint64_t> after, uint32_t nsid, uint32_t max_records) {
  if (!remote_) {
    raise_value("removed() reads gdkvd's removal log: it needs a client of gdkv.connect");
  }
  gdkv::RemovedKeys got;
  const CmdResult r = run([&](gdkv::Client&) {
    if (!device_) return CmdResult{Status::kAbortRequested, gdkv::nvme::kSctGeneric, 0};
    return device_->removed(nsid != 0 ? nsid : nsid_, after, &got, max_records);
  });
  check("removed", nullptr, r);
  nb::list keys;
  for (const gdkv::RemovedKeys::Entry& e : got.records) {
    keys.append(nb::bytes(reinterpret_cast<const char*>(e.key.bytes), e.key.len));
  }
  return {got.boot, got.next, got.lost, got.more, keys};
}

nb::list PyClient::exists_many(nb::handle keys_obj) {
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

std::tuple<size_t, nb::object> PyClient::lookup(nb::handle keys_obj) {
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

nb::list PyClient::delete_many(nb::handle keys_obj, bool missing_ok) {
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

nb::list PyClient::put_many(nb::handle keys_obj, nb::handle values_obj, bool low_priority) {
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
    r = c.put_many(keys, spans, low_priority ? gdkv::nvme::kStoreLowPriority : 0, nsid_);
    return CmdResult{};
  });
  return per_key("put_many", keys, r, [](size_t) { return Py_NewRef(Py_None); });
}

std::vector<nb::object> PyClient::get_many(nb::handle keys_obj, size_t /*size_hint*/) {
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

std::vector<nb::object> PyClient::get_many_view(nb::handle keys_obj) {
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

nb::list PyClient::get_many_into(nb::handle keys_obj, nb::handle outs_obj, bool partial) {
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

nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> PyClient::alloc(size_t nbytes) {
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

void PyClient::register_memory(nb::handle obj) {
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
void PyClient::unregister_memory(nb::handle obj) {
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

bool PyClient::reaches(nb::handle obj) {
  Buffer b = get_buffer(obj, false, "buffer");
  if (b.cuda) return cuda_ && registered(b);
  auto dev = device();
  return !remote_ || (dev && dev->contains(b.ptr, b.len));
}

std::tuple<uint64_t, uint64_t> PyClient::copies() {
  std::shared_lock lk(mu_);
  if (!client_) return {closed_copies_.copies, closed_copies_.bytes};
  const gdkv::CopyCounters c = client_->copies();
  return {c.copies, c.bytes};
}

std::vector<std::tuple<std::string, std::vector<std::tuple<std::string, std::string>>, double>>
PyClient::metrics() {
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

void PyClient::close() {
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
bool PyClient::closed() {
  std::shared_lock lk(mu_);
  return client_ == nullptr;
}

void PyClient::raise_closed() {
  raise_error("call", nullptr, -1, kClosed, "this client is closed (" + where_ + ")");
}

template <class F>
CmdResult PyClient::run(F&& f) {
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

void PyClient::check(const char* op, const Key* k, const CmdResult& r) {
  if (r.ok()) return;
  nb::object e = error_of(op, k, r);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
  throw nb::python_error();
}

PyObject* PyClient::item_error(const char* op, const Key& k, const CmdResult& r) {
  if (r.status == Status::kAbortRequested && failed()) check(op, &k, r);
  return error_of(op, &k, r).release().ptr();
}

template <class Ok>
nb::list PyClient::per_key(const char* op, const std::vector<Key>& keys,
                           const std::vector<CmdResult>& r, Ok ok, Status also_ok) {
  nb::list out = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(keys.size())));
  for (size_t i = 0; i < keys.size(); ++i) {
    PyObject* o = r[i].ok() || r[i].status == also_ok ? ok(i) : item_error(op, keys[i], r[i]);
    if (o == nullptr) throw nb::python_error();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), o);
  }
  return out;
}

bool PyClient::failed() {
  std::shared_lock lk(mu_);
  return !client_ || client_->failure() != gdkv::ClientFailure::kNone;
}

nb::object PyClient::error_of(const char* op, const Key* k, const CmdResult& r) {
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

void PyClient::check_fits(const Key& k, uint32_t value_len, const std::vector<Buffer>& bufs,
                          bool partial) {
  if (auto m = fits(value_len, bufs, partial)) {
    raise_error("get_into", &k, static_cast<int>(Status::kInvalidValueSize), kNoFailure, *m);
  }
}

void PyClient::check_cuda(const Buffer& b) {
  if (!b.cuda) return;
  if (!cuda_) {
    raise_value(
        "a CUDA tensor needs a client with CUDA copy engines: gdkv.open(..., "
        "cuda_device=N) in a CUDA build");
  }
  if (!registered(b)) raise_value("CUDA memory must be registered first: client.register(tensor)");
}
bool PyClient::registered(const Buffer& b) {
  std::lock_guard lk(reg_mu_);
  auto it = registered_.upper_bound(reinterpret_cast<uintptr_t>(b.ptr));
  return it != registered_.begin() &&
         reinterpret_cast<uintptr_t>(b.ptr) + b.len <= std::prev(it)->first + std::prev(it)->second;
}

std::vector<gdkv::nvme::ScatterEntry> PyClient::scatter_pieces(const std::vector<Buffer>& bufs) {
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

std::shared_ptr<gdkv::VfioUserDevice> PyClient::device() {
  std::shared_lock lk(mu_);
  return device_;
}

}  // namespace gdkv_py
