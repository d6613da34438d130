// gdkv._core: the Python binding of gdkv::Client (nanobind): the module, and gdkv.open and
// gdkv.connect, which make its Core. The public API is python/gdkv/, which wraps this module; see
// docs/python.md.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "buffers.h"
#include "client.h"
#include "errors.h"
#include "gdkv/backend_factory.h"
#include "gdkv/backend_registry.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"
#include "gdkv/key.h"
#include "gdkv/settings.h"
#include "gdkv/vfio_user.h"
#ifdef GDKV_HAVE_CUDA
#include "gdkv/gpu_runtime.h"
#endif
#include "keys.h"
#include "settings.h"

namespace gdkv_py {
namespace {

using gdkv::Key;

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

// The module's functions and its Core class.
void define_module(nb::module_& m) {
  m.doc() = "gdkv's C++ client (use the gdkv package, not this module)";
  m.def("_set_error_factory", &set_error_factory);
  m.attr("failure_kinds") = failure_kinds();
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
           nb::arg("must_not_exist"), nb::arg("low_priority"))
      .def("get", &PyClient::get, nb::arg("key"), nb::arg("size_hint"))
      .def("get_view", &PyClient::get_view, nb::arg("key"))
      .def("get_into", &PyClient::get_into, nb::arg("key"), nb::arg("out"), nb::arg("partial"))
      .def("exists", &PyClient::exists, nb::arg("key"))
      .def("delete", &PyClient::remove, nb::arg("key"), nb::arg("missing_ok"))
      .def("list", &PyClient::list, nb::arg("prefix").none())
      .def("exists_many", &PyClient::exists_many, nb::arg("keys"))
      .def("lookup", &PyClient::lookup, nb::arg("keys"))
      .def("hint", &PyClient::hint, nb::arg("keys"))
      .def("removed", &PyClient::removed, nb::arg("after").none(), nb::arg("nsid"),
           nb::arg("max_records"))
      .def("delete_many", &PyClient::delete_many, nb::arg("keys"), nb::arg("missing_ok"))
      .def("put_many", &PyClient::put_many, nb::arg("keys"), nb::arg("values"),
           nb::arg("low_priority"))
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

}  // namespace
}  // namespace gdkv_py

NB_MODULE(_core, m) { gdkv_py::define_module(m); }
