// Helpers shared by the vfio-user tests: temporary socket directories and a raw protocol client
// for sending hand-made (and hostile) messages.
#pragma once

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "vfio_user/protocol.h"
#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user::test {

// A fresh directory under /tmp (short: socket paths are limited to 107 bytes), removed after.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::string tmpl = "/tmp/gdkv-" + tag + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
    ::chmod(path_.c_str(), 0755);  // children running as other users must reach the socket
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A bare vfio-user connection.
class RawClient {
 public:
  explicit RawClient(const std::string& dir) {
    sock_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string p = dir + "/cntrl";
    std::memcpy(a.sun_path, p.c_str(), p.size() + 1);
    ok_ = ::connect(sock_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  bool ok() const { return ok_; }
  int fd() const { return sock_.get(); }

  // Sends a command; returns false if the socket failed.
  bool send(uint16_t cmd, std::span<const std::byte> payload, std::span<const int> fds = {},
            uint32_t flags = kTypeCommand, int64_t size_override = -1) {
    Header h{};
    h.id = ++id_;
    h.command = cmd;
    h.size = size_override >= 0 ? static_cast<uint32_t>(size_override)
                                : static_cast<uint32_t>(sizeof(Header) + payload.size());
    h.flags = flags;
    return write_message(sock_.get(), h, payload, fds);
  }
  // Reads the next message (the reply); false on EOF or error.
  bool recv(Message& m) { return read_message(sock_.get(), m) == ReadStatus::kOk; }

  // A request and its reply; returns the reply's errno (0 = success), -1 if the socket failed.
  int call(uint16_t cmd, std::span<const std::byte> payload, Message* reply = nullptr,
           std::span<const int> fds = {}) {
    if (!send(cmd, payload, fds)) return -1;
    Message m;
    if (!recv(m)) return -1;
    const int err = (m.hdr.flags & kErrorFlag) ? static_cast<int>(m.hdr.error) : 0;
    if (reply != nullptr) *reply = std::move(m);
    return err;
  }

  // VERSION 0.0 with QEMU-like capabilities.
  int version() {
    const std::string json = "{\"capabilities\":{\"max_msg_fds\":16}}";
    std::vector<std::byte> p(4 + json.size() + 1);
    const VersionMsg v{0, 0};
    std::memcpy(p.data(), &v, 4);
    std::memcpy(p.data() + 4, json.c_str(), json.size() + 1);
    return call(static_cast<uint16_t>(Cmd::kVersion), p);
  }

  template <class T>
  static std::vector<std::byte> bytes_of(const T& v) {
    std::vector<std::byte> out(sizeof(T));
    std::memcpy(out.data(), &v, sizeof(T));
    return out;
  }

 private:
  UniqueFd sock_;
  bool ok_ = false;
  uint16_t id_ = 0;
};

}  // namespace gdkv::vfio_user::test
