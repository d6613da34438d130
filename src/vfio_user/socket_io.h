// Framed vfio-user messages over a UNIX stream socket, with file descriptors by SCM_RIGHTS.
//
// read_message() reads one header, checks it before trusting its size, then reads exactly the
// payload; descriptors that arrive with any part of the message are collected (close-on-exec) and
// owned by the Message, so every error path closes them. write_message() sends one message,
// finishing partial writes, with descriptors attached to its first byte.
//
// Thread safety: a socket is read by one thread and written by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "vfio_user/protocol.h"

namespace gdkv::vfio_user {

// An owned file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct Message {
  Header hdr{};
  std::vector<std::byte> payload;
  std::vector<UniqueFd> fds;
  bool fds_truncated = false;  // the peer sent more descriptors than we accept (the rest closed)
};

enum class ReadStatus : uint8_t {
  kOk,
  kEof,        // orderly close before a header started
  kIoError,    // error or close in the middle of a message
  kBadHeader,  // header read, failed check_header (see `why`); payload not read
};

// Reads one message. On kBadHeader, m.hdr holds the header and `why` the reason.
ReadStatus read_message(int sock, Message& m, uint32_t max_size = kMaxMessage,
                        HeaderError* why = nullptr);

// Sends header + payload (+ fds). Returns false if the peer is gone or the socket failed.
bool write_message(int sock, const Header& h, std::span<const std::byte> payload,
                   std::span<const int> fds = {});

// A reply header for `request` carrying `payload_size` bytes; `err` != 0 makes it an error reply.
Header reply_header(const Header& request, uint32_t payload_size, int err = 0);

}  // namespace gdkv::vfio_user
