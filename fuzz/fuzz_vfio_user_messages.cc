// libFuzzer target: a stream of vfio-user messages into one client's device session, plus the
// VERSION/JSON decoders on the raw input.
//
// Input: back-to-back messages, each a 16-byte header followed by its payload; a size the input
// cannot back is cut to what remains (the server would wait for more bytes; the fuzzer can't). A
// host buffer is mapped at IOVA 0x10000000 (1 MiB) before the stream, so register writes can
// enable the controller with queues in real memory; maps the input makes without an fd are
// message-only, and the DMA_READ/DMA_WRITE requests for them are dropped, so replies in the input
// meet real outstanding requests. The session is created fresh per input.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gdkv/backend.h"
#include "gdkv/controller.h"
#include "vfio_user/protocol.h"
#include "vfio_user/session.h"

using namespace gdkv;             // NOLINT
using namespace gdkv::vfio_user;  // NOLINT

namespace {

Controller& controller() {
  static Controller* ctl = [] {
    ControllerOptions o;
    o.reactors = 1;
    o.namespaces = 4;
    o.idle_spin_us = 0;
    return new Controller(make_memory_backend(), o);
  }();
  return *ctl;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The decoders alone, on the raw bytes.
  VersionRequest v;
  (void)decode_version(std::as_bytes(std::span(data, size)), &v);
  (void)parse_json(std::string_view(reinterpret_cast<const char*>(data), size));

  SessionConfig cfg;
  cfg.nvme.namespaces = {{1, 1, "a"}, {3, 2, "b"}};
  cfg.dma.max_maps = 16;
  cfg.reset_timeout_ms = 200;
  DeviceSession session(controller(), cfg);
  static std::vector<std::byte> memory(1 << 20);
  (void)session.dma().map_memory(0x10000000, memory.data(), memory.size(), true, true,
                                 MemKind::kHost);
  // Negotiate first, so inputs reach the other commands.
  Message hello;
  hello.hdr = {0, static_cast<uint16_t>(Cmd::kVersion), 20, kTypeCommand, 0};
  hello.payload.resize(4);
  (void)session.handle(hello);

  size_t at = 0;
  while (size - at >= sizeof(Header)) {
    Message m;
    std::memcpy(&m.hdr, data + at, sizeof(Header));
    at += sizeof(Header);
    if (check_header(m.hdr) != HeaderError::kOk) break;  // the server closes here
    const size_t want = m.hdr.size - sizeof(Header);
    const size_t take = std::min(want, size - at);
    m.payload.assign(reinterpret_cast<const std::byte*>(data + at),
                     reinterpret_cast<const std::byte*>(data + at + take));
    at += take;
    Reply r = session.handle(m);
    if (r.send && r.hdr.size != sizeof(Header) + r.payload.size()) __builtin_trap();
    if (r.close_after) break;
    // DMA_READ/DMA_WRITE requests for message-only maps go nowhere; replies in the input meet them.
    session.dma_pump([](const Header& h, std::span<const std::byte> payload) {
      if (h.size != sizeof(Header) + payload.size()) __builtin_trap();
      return true;
    });
  }
  return 0;
}
