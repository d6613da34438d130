// The vfio-user wire layer: header checks, VERSION payloads and capabilities JSON, and framed
// messages with descriptors over a real socket pair.
#include "vfio_user/protocol.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "vfio_user/socket_io.h"

namespace gdkv::vfio_user {
namespace {

std::vector<std::byte> bytes(const void* p, size_t n) {
  std::vector<std::byte> v(n);
  std::memcpy(v.data(), p, n);
  return v;
}

std::vector<std::byte> version_payload(uint16_t major, uint16_t minor, const std::string& json,
                                       bool nul = true) {
  VersionMsg v{major, minor};
  auto out = bytes(&v, sizeof(v));
  for (char c : json) out.push_back(static_cast<std::byte>(c));
  if (nul) out.push_back(std::byte{0});
  return out;
}

TEST(Header, Checks) {
  Header h{1, 1, 16, kTypeCommand, 0};
  EXPECT_EQ(check_header(h), HeaderError::kOk);
  h.size = 15;
  EXPECT_EQ(check_header(h), HeaderError::kTooShort);
  h.size = kMaxMessage + 1;
  EXPECT_EQ(check_header(h), HeaderError::kTooLarge);
  h.size = 32;
  h.flags = 7;
  EXPECT_EQ(check_header(h), HeaderError::kBadType);
  h.flags = kTypeReply | kErrorFlag;
  EXPECT_EQ(check_header(h), HeaderError::kOk);
}

TEST(PayloadReader, BoundsChecked) {
  const uint8_t raw[6] = {1, 2, 3, 4, 5, 6};
  PayloadReader r(std::as_bytes(std::span(raw)));
  EXPECT_TRUE(r.get<uint32_t>(0).has_value());
  EXPECT_TRUE(r.get<uint32_t>(2).has_value());
  EXPECT_FALSE(r.get<uint32_t>(3).has_value());
  EXPECT_FALSE(r.get<uint64_t>(0).has_value());
  EXPECT_FALSE(r.get<uint8_t>(SIZE_MAX).has_value());
  EXPECT_EQ(r.tail(6).size(), 0u);
  EXPECT_EQ(r.tail(100).size(), 0u);
}

TEST(Version, WithoutJsonLikeSpdk) {
  VersionRequest v;
  ASSERT_EQ(decode_version(version_payload(0, 1, "", false), &v), 0);
  EXPECT_EQ(v.major, 0);
  EXPECT_EQ(v.minor, 1);
  EXPECT_FALSE(v.caps.has_json);
  // A reply always carries JSON, even for a client that sent none.
  EXPECT_EQ(version_reply_json(v.caps, 1024), "{\"capabilities\":{}}");
}

TEST(Version, QemuStyleCapabilities) {
  const std::string json =
      "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,"
      "\"pgsizes\":4096,\"max_dma_maps\":65535,\"write_multiple\":true,"
      "\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":268435456}}}";
  VersionRequest v;
  ASSERT_EQ(decode_version(version_payload(0, 0, json), &v), 0);
  EXPECT_TRUE(v.caps.has_json);
  EXPECT_EQ(v.caps.max_msg_fds, 16u);
  EXPECT_EQ(v.caps.max_dma_maps, 65535u);
  EXPECT_EQ(v.caps.write_multiple, true);
  EXPECT_TRUE(v.caps.migration);
  const std::string reply = version_reply_json(v.caps, 1024);
  // A subset of the proposal, no migration, and shorter than the request (QEMU's buffer rule).
  EXPECT_LT(reply.size() + 1, json.size() + 1);
  auto doc = parse_json(reply);
  ASSERT_TRUE(doc.has_value());
  const JsonValue* caps = doc->find("capabilities");
  ASSERT_NE(caps, nullptr);
  EXPECT_EQ(caps->find("max_dma_maps")->u, 1024u);
  EXPECT_EQ(caps->find("migration"), nullptr);
  EXPECT_TRUE(caps->find("write_multiple")->b);
}

TEST(Version, Malformed) {
  VersionRequest v;
  EXPECT_EQ(decode_version({}, &v), EINVAL);                                  // too short
  EXPECT_EQ(decode_version(version_payload(0, 0, "{}", false), &v), EINVAL);  // no NUL
  EXPECT_EQ(decode_version(version_payload(0, 0, "{"), &v), EINVAL);
  EXPECT_EQ(decode_version(version_payload(0, 0, "[1,2]"), &v), EINVAL);  // not an object
  EXPECT_EQ(decode_version(version_payload(0, 0, "{\"capabilities\":3}"), &v), EINVAL);
  EXPECT_EQ(decode_version(version_payload(0, 0, "{\"capabilities\":{\"max_msg_fds\":-1}}"), &v),
            EINVAL);
  EXPECT_EQ(decode_version(version_payload(0, 0, "{\"capabilities\":{\"max_msg_fds\":1.5}}"), &v),
            EINVAL);
  EXPECT_EQ(
      decode_version(version_payload(0, 0, "{\"capabilities\":{\"write_multiple\":\"yes\"}}"), &v),
      EINVAL);
  EXPECT_EQ(decode_version(version_payload(0, 0, std::string(kMaxVersionJson + 1, ' ')), &v),
            EINVAL);
  EXPECT_EQ(decode_version(version_payload(0, 0, "   "), &v), 0);  // empty document
}

TEST(Json, Grammar) {
  EXPECT_TRUE(parse_json("{\"a\":[1,2.5,-3e2,true,false,null,\"x\\u00e9\\n\"]}").has_value());
  EXPECT_TRUE(parse_json(" {} ").has_value());
  EXPECT_FALSE(parse_json("{} {}").has_value());
  EXPECT_FALSE(parse_json("{\"a\":}").has_value());
  EXPECT_FALSE(parse_json("{\"a\" 1}").has_value());
  EXPECT_FALSE(parse_json("[1,]").has_value());
  EXPECT_FALSE(parse_json("01").has_value());
  EXPECT_FALSE(parse_json("\"\\ud800\"").has_value());  // lone surrogate
  EXPECT_FALSE(parse_json("\"a\nb\"").has_value());     // raw control character
  EXPECT_FALSE(parse_json("tru").has_value());
  EXPECT_FALSE(parse_json("").has_value());
  auto big = parse_json("18446744073709551616");  // 2^64: a number, not a uint
  ASSERT_TRUE(big.has_value());
  EXPECT_FALSE(big->is_uint);
  auto max = parse_json("18446744073709551615");
  ASSERT_TRUE(max.has_value());
  EXPECT_TRUE(max->is_uint);
  EXPECT_EQ(max->u, UINT64_MAX);
  // Depth is bounded: a hostile document cannot exhaust the stack.
  EXPECT_FALSE(parse_json(std::string(100000, '[') + std::string(100000, ']')).has_value());
  EXPECT_TRUE(parse_json(std::string(10, '[') + std::string(10, ']')).has_value());
}

TEST(Socket, MessagesWithDescriptors) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  UniqueFd pr(pipefd[0]), pw(pipefd[1]);

  std::vector<std::byte> payload(100000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 7);
  Header h{42, static_cast<uint16_t>(Cmd::kDmaMap),
           static_cast<uint32_t>(sizeof(Header) + payload.size()), kTypeCommand, 0};
  const int fds[1] = {pw.get()};
  std::thread writer([&] { EXPECT_TRUE(write_message(a.get(), h, payload, fds)); });
  Message m;
  ASSERT_EQ(read_message(b.get(), m), ReadStatus::kOk);
  writer.join();
  EXPECT_EQ(m.hdr.id, 42);
  EXPECT_EQ(m.payload, payload);
  ASSERT_EQ(m.fds.size(), 1u);
  EXPECT_FALSE(m.fds_truncated);
  EXPECT_TRUE(::fcntl(m.fds[0].get(), F_GETFD) & FD_CLOEXEC);
  // The received descriptor is the pipe's write end.
  ASSERT_EQ(::write(m.fds[0].get(), "x", 1), 1);
  char c;
  ASSERT_EQ(::read(pr.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');

  // A header that claims too much is reported without reading on; EOF is clean.
  Header big{1, 1, kMaxMessage + 100, kTypeCommand, 0};
  ASSERT_TRUE(write_message(a.get(), big, {}));
  HeaderError why;
  EXPECT_EQ(read_message(b.get(), m, kMaxMessage, &why), ReadStatus::kBadHeader);
  EXPECT_EQ(why, HeaderError::kTooLarge);
  a.reset();
  EXPECT_EQ(read_message(b.get(), m), ReadStatus::kEof);
}

TEST(Socket, TooManyDescriptorsAreClosed) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  std::vector<int> many;
  for (uint32_t i = 0; i < kMaxMsgFds + 4; ++i) many.push_back(::open("/dev/null", O_RDONLY));
  // write_message refuses to send more than the limit; build the message by hand instead.
  Header h{1, static_cast<uint16_t>(Cmd::kDeviceSetIrqs), sizeof(Header), kTypeCommand, 0};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 64)];
  iovec iov{&h, sizeof(h)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * many.size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * many.size());
  std::memcpy(CMSG_DATA(c), many.data(), sizeof(int) * many.size());
  ASSERT_GT(::sendmsg(a.get(), &msg, 0), 0);
  for (int fd : many) ::close(fd);
  Message m;
  ASSERT_EQ(read_message(b.get(), m), ReadStatus::kOk);
  EXPECT_TRUE(m.fds_truncated);
  EXPECT_LE(m.fds.size(), kMaxMsgFds);
}

}  // namespace
}  // namespace gdkv::vfio_user
