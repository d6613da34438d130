// gdkv._core's Core: PyClient, the binding of one gdkv::Client (in-process, or gdkvd's through a
// VfioUserDevice) and of the memory registered with it.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <vector>

#include "buffers.h"
#include "gdkv/client.h"
#include "gdkv/vfio_user.h"

namespace gdkv_py {

namespace nb = nanobind;

// _core.Core, which gdkv.Client wraps. Threads: every call releases the GIL while it waits;
// close() waits for calls in flight.
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
  void put(nb::handle key, nb::handle value, bool must_exist, bool must_not_exist,
           bool low_priority);

  // One Retrieve whatever the value's length (Client::get_value: received in memory gdkvd
  // writes in place), then the one copy a bytes object needs. `size_hint` is no longer used.
  nb::bytes get(nb::handle key, size_t /*size_hint*/);

  // The value where it was received, no copy: a read-only memoryview that owns the memory until
  // it is released (memoryview.release(), or its last reference gone).
  nb::ndarray<nb::memview, const uint8_t, nb::ndim<1>> get_view(nb::handle key);

  uint32_t get_into(nb::handle key, nb::handle out, bool partial);

  bool exists(nb::handle key);

  bool remove(nb::handle key, bool missing_ok);

  std::vector<nb::bytes> list(nb::handle prefix);

  // A scheduler hint: these keys will be read soon, in this order (one Prefetch with the hint
  // option). Empty list or one too long: ValueError (02h); bad key: the key error.
  void hint(nb::handle keys_obj);

  // The keys gdkvd removed from namespace `nsid` (0: this client's) after the cursor `after`
  // (None: none, the position to start from), at most `max_records`: VfioUserDevice::removed,
  // log page C0h. (boot, next cursor, lost, more, [key bytes...]). ValueError in-process.
  std::tuple<uint64_t, uint64_t, bool, bool, nb::list> removed(std::optional<uint64_t> after,
                                                               uint32_t nsid, uint32_t max_records);

  // ---- batches: one submission round for many keys, one result per key ----
  // A key whose command failed gets its gdkv.Error in its place (not raised); a failed or closed
  // client raises, as every call does.
  nb::list exists_many(nb::handle keys_obj);

  // (how many leading keys exist, None or the error of the key whose Exist failed and so ended
  // the run): Client::lookup_prefix's rounds of 16, 32, 64... keys.
  std::tuple<size_t, nb::object> lookup(nb::handle keys_obj);

  nb::list delete_many(nb::handle keys_obj, bool missing_ok);

  nb::list put_many(nb::handle keys_obj, nb::handle values_obj, bool low_priority);

  // Client::get_values: one Retrieve per key where the memory allows (see its comment). Each
  // value is copied into its bytes object as its command completes, while the controller works
  // on the later ones, and its memory given back at once; None where the key is missing.
  // `size_hint` is no longer used.
  std::vector<nb::object> get_many(nb::handle keys_obj, size_t /*size_hint*/);

  // get_many's values as get_view's read-only memoryviews (each holds its memory while it
  // lives); None where the key is missing.
  std::vector<nb::object> get_many_view(nb::handle keys_obj);

  // Each value's full length, or its error: KeyNotFoundError for a missing key, ValueSizeError
  // for one longer than its buffers (unless partial: then its first bytes landed).
  nb::list get_many_into(nb::handle keys_obj, nb::handle outs_obj, bool partial);

  // ---- memory ----
  // `nbytes` of memory the controller reaches in place, as a numpy uint8 array.
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> alloc(size_t nbytes);

  // Makes memory the caller already has reachable in place, until unregister(): a CUDA tensor by
  // the controller's copy engines (in-process with cuda_device); host memory through gdkvd
  // shared in place (VfioUserDevice::share: its pages moved onto a memfd gdkvd maps, at the same
  // addresses), and in-process as it is. The object is kept alive while registered.
  void register_memory(nb::handle obj);
  void unregister_memory(nb::handle obj);

  // Whether the controller reads and writes `obj`'s memory in place (no staging copy).
  bool reaches(nb::handle obj);

  std::tuple<uint64_t, uint64_t> copies();

  std::vector<std::tuple<std::string, std::vector<std::tuple<std::string, std::string>>, double>>
  metrics();

  void close();
  bool closed();
  const std::string& where() const { return where_; }
  uint32_t nsid() const { return nsid_; }
  bool remote() const { return remote_; }

 private:
  [[noreturn]] void raise_closed();

  // Runs f(client) without the GIL; raises if the client is closed.
  template <class F>
  gdkv::CmdResult run(F&& f);

  void check(const char* op, const gdkv::Key* k, const gdkv::CmdResult& r);

  // The error of one key's failed command in a batch (a new reference); a failed client raises.
  PyObject* item_error(const char* op, const gdkv::Key& k, const gdkv::CmdResult& r);

  // The list of a batch's results: ok(i) (a new reference) for a key whose command succeeded
  // or ended with `also_ok` (87h where a missing key is an answer), else the key's error.
  template <class Ok>
  nb::list per_key(const char* op, const std::vector<gdkv::Key>& keys,
                   const std::vector<gdkv::CmdResult>& r, Ok ok,
                   gdkv::nvme::Status also_ok = gdkv::nvme::Status::kSuccess);

  bool failed();

  // The gdkv.Error for a failed command: TimeoutError or ConnectionError once the client failed.
  nb::object error_of(const char* op, const gdkv::Key* k, const gdkv::CmdResult& r);

  void check_fits(const gdkv::Key& k, uint32_t value_len, const std::vector<Buffer>& bufs,
                  bool partial);

  // CUDA memory needs a client whose controller has CUDA copy engines, and registration (the
  // controller must know device memory as such; it would take an unknown address for host memory).
  void check_cuda(const Buffer& b);
  bool registered(const Buffer& b);

  // Pieces of a value laid out across `bufs` in order. Through gdkvd they must be shared memory.
  std::vector<gdkv::nvme::ScatterEntry> scatter_pieces(const std::vector<Buffer>& bufs);

  // The connection, while open (close() drops it): read it through device().
  std::shared_ptr<gdkv::VfioUserDevice> device();

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

}  // namespace gdkv_py
