// The /metrics HTTP server (and /removed), the removal log and the copy-engine peak measurement.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#include "gdkv/metrics_server.h"
#include "metrics_http.h"

namespace gdkv {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxHead = 8192;  // bytes of request line and headers
constexpr size_t kMaxConns = 64;
constexpr auto kRequestTimeout = std::chrono::seconds(5);
constexpr auto kLinger = std::chrono::seconds(1);

bool valid_method(std::string_view m) {
  if (m.empty() || m.size() > 16) return false;
  return std::all_of(m.begin(), m.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
}

}  // namespace

struct MetricsServer::Impl {
  enum class State { kReading, kWriting, kLingering };
  struct Conn {
    int fd = -1;
    State state = State::kReading;
    std::string in;
    std::string out;
    size_t sent = 0;
    Clock::time_point deadline;
  };

  std::function<MetricList()> source;
  const RemovalLog* removals = nullptr;
  int listen_fd = -1;
  int wake_fd = -1;
  uint16_t port = 0;
  std::vector<Conn> conns;
  std::thread thread;

  ~Impl() {
    for (Conn& c : conns) close_conn(c);
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  static void close_conn(Conn& c) {
    if (c.fd >= 0) ::close(c.fd);
    c.fd = -1;
  }

  void run() {
    std::vector<pollfd> pfds;
    for (;;) {
      pfds.clear();
      pfds.push_back(pollfd{wake_fd, POLLIN, 0});
      pfds.push_back(pollfd{listen_fd, POLLIN, 0});
      Clock::time_point next = Clock::now() + std::chrono::seconds(1);
      for (const Conn& c : conns) {
        pfds.push_back(
            pollfd{c.fd, static_cast<short>(c.state == State::kWriting ? POLLOUT : POLLIN), 0});
        next = std::min(next, c.deadline);
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now());
      const int timeout = static_cast<int>(std::clamp<int64_t>(wait.count() + 1, 0, 1000));
      const int n = ::poll(pfds.data(), pfds.size(), timeout);
      if (n < 0 && errno != EINTR) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (pfds[0].revents != 0) break;
      const Clock::time_point now = Clock::now();
      for (size_t i = 0; i < conns.size(); ++i) {
        Conn& c = conns[i];
        const short ev = pfds[i + 2].revents;
        if (ev != 0) service(c, ev, now);
        if (c.fd >= 0 && now >= c.deadline) close_conn(c);  // slow or stuck client
      }
      std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
      if (pfds[1].revents & POLLIN) accept_all(now);
    }
  }

  void accept_all(Clock::time_point now) {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection that died in the backlog
      if (conns.size() >= kMaxConns) {
        // Full: the connection closest to its deadline makes room (likely a slow one).
        auto oldest =
            std::min_element(conns.begin(), conns.end(),
                             [](const Conn& a, const Conn& b) { return a.deadline < b.deadline; });
        close_conn(*oldest);
        conns.erase(oldest);
      }
      Conn c;
      c.fd = fd;
      c.deadline = now + kRequestTimeout;
      conns.push_back(std::move(c));
    }
  }

  void service(Conn& c, short ev, Clock::time_point now) {
    if (c.state == State::kWriting) {
      if (ev & (POLLERR | POLLNVAL)) return close_conn(c);
      return write_some(c, now);
    }
    if (ev & POLLNVAL) return close_conn(c);
    char buf[4096];
    bool eof = false;
    for (int reads = 0; reads < 16; ++reads) {  // bounded: a flooding client can't hog us
      const ssize_t r = ::recv(c.fd, buf, sizeof(buf), 0);
      if (r > 0) {
        if (c.state == State::kLingering) continue;  // discard what follows the request
        c.in.append(buf, static_cast<size_t>(r));
        if (c.in.size() > kMaxHead) break;  // enough to decide
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      eof = !(r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));  // EOF or error
      break;
    }
    if (c.state == State::kReading) {
      // A client may send its request and half-close at once: answer it all the same.
      const size_t end = head_end(c.in);
      if (end != std::string::npos && end <= kMaxHead) return handle(c, end, now);
      if (c.in.size() > kMaxHead) {
        return respond(c, "431 Request Header Fields Too Large", "request head too large\n", false,
                       now);
      }
    }
    if (eof) close_conn(c);
  }

  static size_t head_end(const std::string& in) {
    const size_t crlf = in.find("\r\n\r\n");
    const size_t lf = in.find("\n\n");
    return std::min(crlf, lf);
  }

  void handle(Conn& c, size_t end, Clock::time_point now) {
    const HttpAnswer a = http_answer(std::string_view(c.in.data(), end), source, removals);
    respond(c, a.status, a.body, a.head_only, now, a.extra, a.type);
  }

  void respond(Conn& c, std::string_view status, std::string_view body, bool head_only,
               Clock::time_point now, std::string_view extra = "",
               std::string_view type = "text/plain; charset=utf-8") {
    c.out.clear();
    c.out += "HTTP/1.1 ";
    c.out += status;
    c.out += "\r\nContent-Type: ";
    c.out += type;
    c.out += "\r\nContent-Length: ";
    c.out += std::to_string(body.size());
    c.out += "\r\nConnection: close\r\n";
    c.out += extra;
    c.out += "\r\n";
    if (!head_only) c.out += body;
    c.sent = 0;
    c.in.clear();
    c.in.shrink_to_fit();
    c.state = State::kWriting;
    c.deadline = now + kRequestTimeout;
    write_some(c, now);
  }

  void write_some(Conn& c, Clock::time_point now) {
    while (c.sent < c.out.size()) {
      const ssize_t w =
          ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        c.sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // wait for POLLOUT
      return close_conn(c);
    }
    // Sent: half-close and read what the client still sends until it closes, so unread request
    // bytes don't turn our close into a reset that discards the response on its side.
    ::shutdown(c.fd, SHUT_WR);
    c.out.clear();
    c.out.shrink_to_fit();
    c.state = State::kLingering;
    c.deadline = now + kLinger;
  }
};

namespace {

HttpAnswer reply(std::string status, std::string body, bool head_only = false,
                 std::string extra = "", std::string type = "text/plain; charset=utf-8") {
  return HttpAnswer{std::move(status), std::move(body), head_only, std::move(extra),
                    std::move(type)};
}

}  // namespace

HttpAnswer http_answer(std::string_view head, const std::function<MetricList()>& source,
                       const RemovalLog* removals) {
  std::string_view line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t s1 = line.find(' ');
  const size_t s2 = s1 == std::string_view::npos ? s1 : line.find(' ', s1 + 1);
  if (s1 == std::string_view::npos || s2 == std::string_view::npos ||
      line.find(' ', s2 + 1) != std::string_view::npos) {
    return reply("400 Bad Request", "bad request line\n");
  }
  const std::string_view method = line.substr(0, s1);
  const std::string_view target = line.substr(s1 + 1, s2 - s1 - 1);
  const std::string_view version = line.substr(s2 + 1);
  if (!valid_method(method) || target.empty() || target[0] != '/' ||
      !version.starts_with("HTTP/1.")) {
    return reply("400 Bad Request", "bad request line\n");
  }
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    return reply("405 Method Not Allowed", "only GET and HEAD\n", head_only,
                 "Allow: GET, HEAD\r\n");
  }
  const std::string_view path = target.substr(0, target.find('?'));
  if (path == "/removed" && removals != nullptr) {
    // GET /removed[?after=SEQ]: RemovalLog::json. Any other query is 400.
    std::optional<uint64_t> after;
    const size_t q = target.find('?');
    if (q != std::string_view::npos) {
      const std::string_view query = target.substr(q + 1);
      constexpr std::string_view kAfter = "after=";
      uint64_t v = 0;
      const char* end = query.data() + query.size();
      const auto [p, ec] = query.starts_with(kAfter)
                               ? std::from_chars(query.data() + kAfter.size(), end, v)
                               : std::from_chars_result{query.data(), std::errc::invalid_argument};
      if (ec != std::errc() || p != end || query.size() == kAfter.size()) {
        return reply("400 Bad Request", "query: after=SEQ (a decimal number) or none\n", head_only);
      }
      after = v;
    }
    return reply("200 OK", removals->json(after), head_only, "", "application/json");
  }
  if (path != "/metrics") return reply("404 Not Found", "not found; try /metrics\n", head_only);
  try {
    return reply("200 OK", prometheus_text(source()), head_only, "",
                 "text/plain; version=0.0.4; charset=utf-8");
  } catch (const std::exception& e) {
    return reply("500 Internal Server Error", std::string("collect failed: ") + e.what() + "\n",
                 head_only);
  }
}

RemovalLog::RemovalLog(size_t capacity)
    : capacity_(std::max<size_t>(capacity, 1)),
      boot_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::system_clock::now().time_since_epoch())
                                      .count())) {}

void RemovalLog::add(uint32_t nsid, const Key& key) {
  std::lock_guard lk(mu_);
  records_.push_back(Record{++last_, nsid, key});
  if (records_.size() > capacity_) records_.pop_front();
}

RemovalLog::Slice RemovalLog::slice(std::optional<uint64_t> after, size_t max,
                                    std::optional<uint32_t> nsid, size_t max_scan) const {
  Slice out;
  out.boot = boot_;
  std::lock_guard lk(mu_);  // only copies: the data path's add() waits on this lock
  out.last = last_;
  out.first = records_.empty() ? last_ + 1 : records_.front().seq;
  out.next = after ? std::min(*after, last_) : last_;
  if (!after) return out;
  out.lost = *after > last_ || out.first > *after + 1;
  if (*after >= last_) return out;
  // Records are consecutive: the one after `after` is at index after + 1 - first.
  size_t i = *after + 1 > out.first ? static_cast<size_t>(*after + 1 - out.first) : 0;
  out.records.reserve(std::min({max, max_scan, records_.size() - std::min(i, records_.size())}));
  for (size_t scanned = 0; i < records_.size(); ++i, ++scanned) {
    const Record& r = records_[i];
    if (scanned == max_scan) break;
    const bool match = !nsid || r.nsid == *nsid;
    if (match && out.records.size() == max) break;
    out.next = r.seq;
    if (match) {
      out.records.push_back(r);
    } else if (r.nsid == 0) {
      out.lost = true;
    }
  }
  out.more = out.next < last_;
  return out;
}

std::string RemovalLog::json(std::optional<uint64_t> after, size_t max) const {
  const Slice s = slice(after, max, std::nullopt, max);
  // Appended piece by piece (GCC 12 warns, wrongly, on chains of std::string operator+).
  std::string out = "{\"boot\": ";
  out += std::to_string(s.boot);
  out += ", \"last\": ";
  out += std::to_string(s.last);
  out += ", \"first\": ";
  out += std::to_string(s.first);
  out += ", \"lost\": ";
  out += s.lost ? "true" : "false";
  out += ", \"removed\": [";
  for (size_t n = 0; n < s.records.size(); ++n) {
    const Record& r = s.records[n];
    if (n) out += ", ";
    out += '[';
    out += std::to_string(r.seq);
    out += ", ";
    out += std::to_string(r.nsid);
    out += ", \"";
    out += r.key.hex();
    out += "\"]";
  }
  out += "]}\n";
  return out;
}

MetricsServer::MetricsServer(uint16_t port, std::function<MetricList()> source,
                             const std::string& bind_address, const RemovalLog* removals)
    : impl_(std::make_unique<Impl>()) {
  impl_->source = std::move(source);
  impl_->removals = removals;
  const std::string where = bind_address + ":" + std::to_string(port);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, bind_address.c_str(), &addr.sin_addr) != 1) {
    throw std::runtime_error("metrics server: '" + bind_address + "' is not an IPv4 address");
  }
  impl_->listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (impl_->listen_fd < 0) {
    throw std::runtime_error(std::string("metrics server: socket: ") + std::strerror(errno));
  }
  const int one = 1;
  ::setsockopt(impl_->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(impl_->listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(impl_->listen_fd, 128) != 0) {
    throw std::runtime_error("metrics server: cannot listen on " + where + ": " +
                             std::strerror(errno));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(impl_->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  impl_->port = ntohs(addr.sin_port);
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) {
    throw std::runtime_error(std::string("metrics server: eventfd: ") + std::strerror(errno));
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(uint16_t port,
                                                            std::function<MetricList()> source,
                                                            const std::string& bind_address,
                                                            const RemovalLog* removals) {
  return catch_error([&] {
    return std::unique_ptr<MetricsServer>(
        new MetricsServer(port, std::move(source), bind_address, removals));
  });
}

MetricsServer::~MetricsServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(impl_->wake_fd, &one, sizeof(one));
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint16_t MetricsServer::port() const { return impl_->port; }

// ---- copy-engine peak ---------------------------------------------------------------------------

double measure_copy_peak_bps(CopyEngine& engine, const CopyPeakOptions& o) {
  if (o.bytes == 0) return 0;
  std::unique_ptr<std::byte[]> own_src, own_dst;
  const void* src = o.src;
  void* dst = o.dst;
  if (src == nullptr) {
    own_src = std::make_unique_for_overwrite<std::byte[]>(o.bytes);
    std::memset(own_src.get(), 0x5A, o.bytes);  // fault the pages in before timing
    src = own_src.get();
  }
  if (dst == nullptr) {
    own_dst = std::make_unique_for_overwrite<std::byte[]>(o.bytes);
    std::memset(own_dst.get(), 0, o.bytes);
    dst = own_dst.get();
  }
  struct Result {
    bool done = false;
    nvme::Status status = nvme::Status::kSuccess;
  } result;
  double best = 0;
  for (uint32_t round = 0; round <= o.rounds; ++round) {
    CopyJob job;
    const size_t piece = (o.bytes + CopyJob::kInlineSegments - 1) / CopyJob::kInlineSegments;
    for (size_t off = 0; off < o.bytes; off += piece) {
      const size_t n = std::min(piece, o.bytes - off);
      job.segs[job.count++] =
          CopySegment{static_cast<std::byte*>(dst) + off, static_cast<const std::byte*>(src) + off,
                      n, o.dst_kind, o.src_kind};
    }
    job.user = &result;
    job.done = [](CopyJob* j, nvme::Status s) {
      auto* r = static_cast<Result*>(j->user);
      r->status = s;
      r->done = true;
    };
    result = Result{};
    const auto t0 = Clock::now();
    engine.submit(&job);
    while (!result.done) engine.poll();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (result.status != nvme::Status::kSuccess) return 0;
    if (round > 0 && secs > 0) best = std::max(best, static_cast<double>(o.bytes) / secs);
  }
  return best;
}

}  // namespace gdkv
