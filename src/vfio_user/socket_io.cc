#include "vfio_user/socket_io.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace gdkv::vfio_user {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace {

// One recvmsg; appends received descriptors to `m`. Returns bytes read, 0 on EOF, -1 on error.
ssize_t recv_some(int sock, void* buf, size_t len, Message& m) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxMsgFds)];
  iovec iov{buf, len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  // Descriptors beyond our control buffer were closed by the kernel; remember that it happened.
  if (msg.msg_flags & MSG_CTRUNC) m.fds_truncated = true;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (m.fds.size() < kMaxMsgFds) {
        m.fds.emplace_back(fd);
      } else {
        ::close(fd);
        m.fds_truncated = true;
      }
    }
  }
  return n;
}

// Reads exactly `len` bytes. 1 = done, 0 = EOF before any byte, -1 = error or EOF mid-way.
int recv_exact(int sock, void* buf, size_t len, Message& m) {
  auto* p = static_cast<std::byte*>(buf);
  size_t got = 0;
  while (got < len) {
    const ssize_t n = recv_some(sock, p + got, len - got, m);
    if (n < 0) return -1;
    if (n == 0) return got == 0 ? 0 : -1;
    got += static_cast<size_t>(n);
  }
  return 1;
}

}  // namespace

ReadStatus read_message(int sock, Message& m, uint32_t max_size, HeaderError* why) {
  m.payload.clear();
  m.fds.clear();
  m.fds_truncated = false;
  const int r = recv_exact(sock, &m.hdr, sizeof(Header), m);
  if (r == 0) return ReadStatus::kEof;
  if (r < 0) return ReadStatus::kIoError;
  const HeaderError e = check_header(m.hdr, max_size);
  if (why != nullptr) *why = e;
  if (e != HeaderError::kOk) return ReadStatus::kBadHeader;
  m.payload.resize(m.hdr.size - sizeof(Header));
  if (!m.payload.empty() && recv_exact(sock, m.payload.data(), m.payload.size(), m) != 1) {
    return ReadStatus::kIoError;
  }
  return ReadStatus::kOk;
}

bool write_message(int sock, const Header& h, std::span<const std::byte> payload,
                   std::span<const int> fds) {
  if (fds.size() > kMaxMsgFds) return false;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxMsgFds)];
  iovec iov[2] = {{const_cast<Header*>(&h), sizeof(Header)},
                  {const_cast<std::byte*>(payload.data()), payload.size()}};
  size_t total = sizeof(Header) + payload.size();
  size_t sent = 0;
  bool first = true;
  while (sent < total) {
    // Rebuild the iovec past what was sent already.
    iovec cur[2];
    int n_iov = 0;
    size_t skip = sent;
    for (const iovec& v : iov) {
      if (skip >= v.iov_len) {
        skip -= v.iov_len;
        continue;
      }
      cur[n_iov].iov_base = static_cast<char*>(v.iov_base) + skip;
      cur[n_iov].iov_len = v.iov_len - skip;
      skip = 0;
      ++n_iov;
    }
    msghdr msg{};
    msg.msg_iov = cur;
    msg.msg_iovlen = static_cast<size_t>(n_iov);
    if (first && !fds.empty()) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t n;
    do {
      n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
    first = false;
  }
  return true;
}

Header reply_header(const Header& request, uint32_t payload_size, int err) {
  Header h{};
  h.id = request.id;
  h.command = request.command;
  h.flags = kTypeReply;
  if (err != 0) {
    h.flags |= kErrorFlag;
    h.error = static_cast<uint32_t>(err);
    payload_size = 0;  // an error reply is the header alone
  }
  h.size = static_cast<uint32_t>(sizeof(Header) + payload_size);
  return h;
}

}  // namespace gdkv::vfio_user
