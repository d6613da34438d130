// Prometheus exposition, the stat table, the /metrics server (scraped over a plain socket, and
// fed bad requests), and the copy-engine peak.
#include "gdkv/metrics_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "cache_test_util.h"
#include "gdkv/cache.h"
#include "gdkv/client.h"

namespace gdkv {
namespace {

// ---- a strict parser of the text format: every line a comment or `name{labels} value` ----

struct Scrape {
  std::map<std::string, double> samples;     // "name{k=\"v\",...}" -> value
  std::map<std::string, std::string> types;  // name -> counter|gauge
  std::string error;                         // first problem found

  double get(const std::string& series) const {
    auto it = samples.find(series);
    return it == samples.end() ? -1 : it->second;
  }
};

bool is_name(const std::string& s, bool colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok = std::isalpha(static_cast<unsigned char>(c)) || c == '_' ||
                    (colon && c == ':') || (i > 0 && std::isdigit(static_cast<unsigned char>(c)));
    if (!ok) return false;
  }
  return true;
}

Scrape parse(const std::string& text) {
  Scrape out;
  std::set<std::string> done_families;
  std::string current;
  size_t pos = 0;
  auto fail = [&](const std::string& why, const std::string& line) {
    if (out.error.empty()) out.error = why + ": '" + line + "'";
  };
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) {
      fail("no newline at end", text.substr(pos));
      break;
    }
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::istringstream in(line);
      std::string hash, kind, name, rest;
      in >> hash >> kind >> name;
      if (kind == "TYPE") {
        in >> rest;
        if (rest != "counter" && rest != "gauge") fail("bad type", line);
        if (out.types.contains(name)) fail("second TYPE", line);
        out.types[name] = rest;
        if (!current.empty() && current != name) done_families.insert(current);
        current = name;
      } else if (kind != "HELP") {
        fail("unknown comment", line);
      }
      if (!is_name(name, true)) fail("bad name in comment", line);
      continue;
    }
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    const std::string name = line.substr(0, i);
    if (!is_name(name, true)) fail("bad metric name", line);
    if (name != current) fail("sample outside its family", line);
    if (done_families.contains(name)) fail("family split", line);
    std::string series = name;
    if (i < line.size() && line[i] == '{') {
      series += '{';
      ++i;
      bool first = true;
      while (i < line.size() && line[i] != '}') {
        if (!first) {
          if (line[i] != ',') return fail("expected ,", line), out;
          series += ',';
          ++i;
        }
        first = false;
        size_t eq = line.find('=', i);
        if (eq == std::string::npos) return fail("label without =", line), out;
        const std::string lname = line.substr(i, eq - i);
        if (!is_name(lname, false)) fail("bad label name", line);
        i = eq + 1;
        if (i >= line.size() || line[i] != '"') return fail("unquoted label value", line), out;
        ++i;
        std::string value;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            if (i + 1 >= line.size()) return fail("dangling escape", line), out;
            const char e = line[i + 1];
            if (e == 'n') {
              value += '\n';
            } else if (e == '\\' || e == '"') {
              value += e;
            } else {
              fail("bad escape", line);
            }
            i += 2;
          } else {
            value += line[i++];
          }
        }
        if (i >= line.size()) return fail("unterminated label value", line), out;
        ++i;
        series += lname + "=\"" + value + "\"";
      }
      if (i >= line.size()) return fail("unterminated labels", line), out;
      series += '}';
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') {
      fail("no space before value", line);
      continue;
    }
    const std::string v = line.substr(i + 1);
    double value;
    if (v == "NaN") {
      value = std::nan("");
    } else if (v == "+Inf") {
      value = INFINITY;
    } else if (v == "-Inf") {
      value = -INFINITY;
    } else {
      char* end = nullptr;
      value = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0') fail("bad value", line);
    }
    if (out.samples.contains(series)) fail("duplicate series", line);
    out.samples[series] = value;
  }
  return out;
}

TEST(Prometheus, TextFormat) {
  MetricList ms;
  ms.push_back(Metric{"ops_total", "ops\\done\nhere", MetricType::kCounter, {{"op", "get"}}, 3});
  ms.push_back(Metric{"depth", "queue depth", MetricType::kGauge, {}, 1.5});
  ms.push_back(Metric{"ops_total", "ignored", MetricType::kCounter, {{"op", "a\"b\\c\nd"}}, 4});
  ms.push_back(Metric{"bad-name.x", "sanitized", MetricType::kGauge, {{"9lbl", "v"}}, NAN});
  ms.push_back(Metric{"gdkv_already", "no double prefix", MetricType::kGauge, {}, INFINITY});
  ms.push_back(Metric{"big", "large counter", MetricType::kCounter, {}, 12345678901234.0});
  const std::string text = prometheus_text(ms);
  const Scrape s = parse(text);
  ASSERT_TRUE(s.error.empty()) << s.error << "\n" << text;
  EXPECT_EQ(s.get("gdkv_ops_total{op=\"get\"}"), 3);
  EXPECT_EQ(s.get("gdkv_ops_total{op=\"a\"b\\c\nd\"}"), 4);
  EXPECT_EQ(s.get("gdkv_depth"), 1.5);
  EXPECT_TRUE(std::isnan(s.get("gdkv_bad_name_x{_lbl=\"v\"}")));
  EXPECT_TRUE(std::isinf(s.get("gdkv_already")));
  EXPECT_EQ(s.get("gdkv_big"), 12345678901234.0);
  EXPECT_EQ(s.types.at("gdkv_ops_total"), "counter");
  EXPECT_EQ(s.types.at("gdkv_depth"), "gauge");
  EXPECT_NE(text.find("# HELP gdkv_ops_total ops\\\\done\\nhere\n"), std::string::npos) << text;
  EXPECT_NE(text.find("gdkv_big 12345678901234\n"), std::string::npos) << text;
}

TEST(Prometheus, Table) {
  MetricList ms;
  ms.push_back(Metric{"cache_hits_total", "h", MetricType::kCounter, {}, 42});
  ms.push_back(Metric{"cache_hit_ratio", "r", MetricType::kGauge, {{"policy", "lru"}}, 0.25});
  const std::string t = metrics_table(ms);
  EXPECT_NE(t.find("gdkv_cache_hits_total"), std::string::npos);
  EXPECT_NE(t.find("42\n"), std::string::npos);
  EXPECT_NE(t.find("policy=lru"), std::string::npos);
  EXPECT_NE(t.find("0.25\n"), std::string::npos);
}

// ---- HTTP ----

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

void send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t w = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (w <= 0) return;  // the server may close early on a bad request
    off += static_cast<size_t>(w);
  }
}

std::string read_all(int fd) {
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  return out;
}

std::string request(uint16_t port, const std::string& req) {
  const int fd = connect_to(port);
  if (fd < 0) return "";
  send_all(fd, req);
  std::string r = read_all(fd);
  ::close(fd);
  return r;
}

std::string body_of(const std::string& response) {
  const size_t p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

Scrape scrape(uint16_t port) {
  const std::string r = request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK\r\n")) << r.substr(0, 200);
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  const std::string body = body_of(r);
  EXPECT_NE(r.find("Content-Length: " + std::to_string(body.size()) + "\r\n"), std::string::npos);
  Scrape s = parse(body);
  EXPECT_TRUE(s.error.empty()) << s.error;
  return s;
}

class MetricsServerTest : public testing::Test {
 protected:
  void SetUp() override {
    cache_ = make_cached_backend(make_memory_backend()).value();
    client_ = Client::open(cache_).value();
    server_ = MetricsServer::start(
                  0,
                  [this] {
                    MetricList ms;
                    client_->controller()->collect(ms);
                    return ms;
                  },
                  "127.0.0.1")
                  .value();
    ASSERT_NE(server_->port(), 0);
  }
  std::shared_ptr<Backend> cache_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<MetricsServer> server_;
};

TEST_F(MetricsServerTest, ScrapeParsesAndValuesMove) {
  const Scrape before = scrape(server_->port());
  for (const char* name :
       {"gdkv_commands_total", "gdkv_cache_hits_total", "gdkv_cache_misses_total",
        "gdkv_cache_hit_ratio", "gdkv_cache_evictions_total", "gdkv_cache_bytes",
        "gdkv_cache_prefetch_issued_total", "gdkv_cache_prefetch_used_total",
        "gdkv_cache_prefetch_wasted_total", "gdkv_cache_prefetch_accuracy",
        "gdkv_cache_single_flight_merges_total", "gdkv_backend_ops_total", "gdkv_dma_bytes_total",
        "gdkv_command_latency_seconds"}) {
    EXPECT_TRUE(before.types.contains(name)) << name;
  }
  EXPECT_EQ(before.types.at("gdkv_cache_hits_total"), "counter");
  EXPECT_EQ(before.get("gdkv_cache_hits_total"), 0);

  const Key k = *Key::from_string("metric-key");
  std::vector<std::byte> v(4096, std::byte{7}), buf(4096);
  ASSERT_TRUE(client_->put(k, v).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(client_->get(k, std::span(buf)).ok());
  const Key absent = *Key::from_string("absent");
  EXPECT_FALSE(client_->get(absent, std::span(buf)).ok());

  const Scrape after = scrape(server_->port());
  EXPECT_EQ(after.get("gdkv_cache_hits_total"), 5);
  EXPECT_EQ(after.get("gdkv_cache_misses_total"), 1);
  EXPECT_NEAR(after.get("gdkv_cache_hit_ratio"), 5.0 / 6.0, 1e-9);
  EXPECT_EQ(after.get("gdkv_cache_bytes"), 4096);
  EXPECT_EQ(after.get("gdkv_commands_total{reactor=\"0\",op=\"retrieve\"}"), 6);
  EXPECT_EQ(after.get("gdkv_commands_total{reactor=\"0\",op=\"store\"}"), 1);
  EXPECT_GE(after.get("gdkv_dma_bytes_total{reactor=\"0\",engine=\"host-memcpy\"}"), 5 * 4096);
}

TEST_F(MetricsServerTest, AnswersOtherRequestsWithErrors) {
  const uint16_t p = server_->port();
  EXPECT_TRUE(request(p, "GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
  EXPECT_TRUE(request(p, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
  EXPECT_TRUE(request(p, "garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
  EXPECT_TRUE(request(p, "GET metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 400"));
  EXPECT_TRUE(request(p, "GET /metrics SPDY/3\r\n\r\n").starts_with("HTTP/1.1 400"));
  std::string binary(300, '\0');
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<char>(i * 37);
  request(p, binary + "\n\n");  // whatever it answers, it survives
  // HEAD: the headers, no body. A query string is fine; bare \n line ends too.
  const std::string head = request(p, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200")) << head;
  EXPECT_TRUE(body_of(head).empty());
  EXPECT_TRUE(request(p, "GET /metrics?x=1 HTTP/1.1\n\n").starts_with("HTTP/1.1 200"));
  // Headers without end: 431 once they pass 8 KiB.
  const std::string huge = "GET /metrics HTTP/1.1\r\nX-Filler: " + std::string(100000, 'a');
  EXPECT_TRUE(request(p, huge).starts_with("HTTP/1.1 431"));
  scrape(p);
}

TEST_F(MetricsServerTest, SlowAndBrokenClientsDoNotStallIt) {
  const uint16_t p = server_->port();
  // Clients that connect and say nothing, or half a request, while others scrape.
  std::vector<int> idle;
  for (int i = 0; i < 10; ++i) {
    const int fd = connect_to(p);
    ASSERT_GE(fd, 0);
    if (i % 2) send_all(fd, "GET /metr");
    idle.push_back(fd);
  }
  scrape(p);
  // A client that sends a request and disappears without reading the answer.
  for (int i = 0; i < 5; ++i) {
    const int fd = connect_to(p);
    send_all(fd, "GET /metrics HTTP/1.1\r\n\r\n");
    ::close(fd);
  }
  // More connections than it serves at once: it drops the oldest and keeps answering.
  for (int i = 0; i < 80; ++i) {
    const int fd = connect_to(p);
    if (fd >= 0) idle.push_back(fd);
  }
  scrape(p);
  // A client that half-closes right after its request still gets the answer.
  const int fd = connect_to(p);
  send_all(fd, "GET /metrics HTTP/1.1\r\n\r\n");
  ::shutdown(fd, SHUT_WR);
  EXPECT_TRUE(read_all(fd).starts_with("HTTP/1.1 200"));
  ::close(fd);
  for (int i : idle) ::close(i);
  scrape(p);
}

// ---- /removed: the keys the store stopped holding ----

TEST(RemovalLog, CursorsFirstLastAndLost) {
  RemovalLog log(3);
  const std::string empty = log.json(std::nullopt);
  EXPECT_NE(empty.find("\"last\": 0, \"first\": 1, \"lost\": false, \"removed\": []"),
            std::string::npos)
      << empty;
  for (const char* k : {"a", "b", "c", "d"}) log.add(1, *Key::from_string(k));
  // Without a cursor: positions only. The newest three are kept.
  EXPECT_NE(log.json(std::nullopt)
                .find("\"last\": 4, \"first\": 2, \"lost\": false, "
                      "\"removed\": []"),
            std::string::npos);
  const std::string b = Key::from_string("b")->hex(), c = Key::from_string("c")->hex(),
                    d = Key::from_string("d")->hex();
  // after=1: nothing was dropped after 1, so 2.. follow, oldest first; `max` cuts.
  EXPECT_NE(log.json(1).find("\"lost\": false, \"removed\": [[2, 1, \"" + b + "\"], [3, 1, \"" + c +
                             "\"], [4, 1, \"" + d + "\"]]"),
            std::string::npos)
      << log.json(1);
  EXPECT_NE(log.json(2, 1).find("\"removed\": [[3, 1, \"" + c + "\"]]"), std::string::npos);
  EXPECT_NE(log.json(4).find("\"lost\": false, \"removed\": []"), std::string::npos);
  // after=0: record 1 was dropped unread; after=9: a cursor of another life (a restart).
  EXPECT_NE(log.json(0).find("\"lost\": true, \"removed\": [[2, 1,"), std::string::npos);
  EXPECT_NE(log.json(9).find("\"lost\": true, \"removed\": []"), std::string::npos);
  EXPECT_NE(log.json(UINT64_MAX).find("\"lost\": true"), std::string::npos);
  EXPECT_EQ(log.json(std::nullopt).substr(0, 9), "{\"boot\": ");
}

// Deletes and the memory backend's evictions reach /removed through the host cache; the cache's
// own evictions (the value is still stored) do not; bad queries are 400.
TEST(RemovedFeed, DeletesAndEvictionsOfTheStoreNotOfTheCache) {
  MemoryBackendOptions mo;
  mo.capacity_bytes = 64 << 10;
  CacheOptions co;
  co.capacity_bytes = 16 << 10;
  auto backend = make_cached_backend(make_memory_backend(mo), co).value();
  RemovalLog log;
  backend->set_removal_handler([&log](uint32_t nsid, const Key& k) { log.add(nsid, k); });
  auto client = Client::open(backend).value();
  auto server = MetricsServer::start(
                    0, [] { return MetricList{}; }, "127.0.0.1", &log)
                    .value();
  const uint16_t p = server->port();
  auto get = [p](const std::string& target) {
    return request(p, "GET " + target + " HTTP/1.1\r\nHost: x\r\n\r\n");
  };
  std::vector<std::byte> v(8 << 10, std::byte{1});
  auto key = [](int i) {
    std::string name = std::to_string(i);
    name.insert(name.begin(), 'k');  // not "k" + ...: GCC 12 warns, wrongly (-Wrestrict)
    return *Key::from_string(name);
  };
  // Four values: 32 KiB, twice what the cache holds, half the store: the cache evicts, the
  // store does not.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(client->put(key(i), v).ok());
  std::string r = get("/removed?after=0");
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200")) << r;
  EXPECT_NE(r.find("Content-Type: application/json"), std::string::npos);
  EXPECT_NE(body_of(r).find("\"last\": 0,"), std::string::npos) << body_of(r);
  ASSERT_TRUE(client->del(key(1)).ok());
  EXPECT_FALSE(client->del(key(1)).ok());  // absent: nothing removed
  r = body_of(get("/removed?after=0"));
  EXPECT_NE(r.find("\"removed\": [[1, 1, \"" + key(1).hex() + "\"]]"), std::string::npos) << r;
  // Five more: the store (64 KiB, keys included) evicts its least recently used, k0 first.
  for (int i = 4; i < 9; ++i) ASSERT_TRUE(client->put(key(i), v).ok());
  r = body_of(get("/removed?after=1"));
  EXPECT_NE(r.find("[2, 1, \"" + key(0).hex() + "\"]"), std::string::npos) << r;
  std::vector<std::byte> buf(v.size());
  EXPECT_EQ(client->get(key(0), std::span(buf)).status, nvme::Status::kKeyNotExist);
  // A new subscriber's start: positions only.
  r = body_of(get("/removed"));
  EXPECT_NE(r.find("\"removed\": []"), std::string::npos) << r;
  for (const char* bad :
       {"/removed?after=", "/removed?after=x", "/removed?after=-1", "/removed?after=1&x=2",
        "/removed?since=1", "/removed?after=99999999999999999999999"}) {
    EXPECT_TRUE(get(bad).starts_with("HTTP/1.1 400")) << bad;
  }
  backend->set_removal_handler(nullptr);
}

// Without a log the path is not served.
TEST(RemovedFeed, NotServedWithoutALog) {
  auto server = MetricsServer::start(
                    0, [] { return MetricList{}; }, "127.0.0.1")
                    .value();
  EXPECT_TRUE(request(server->port(), "GET /removed HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
}

// A namespace's reader gets only its records, moves past the others' (next), hears of a record
// with nsid 0 as lost, and reads a long run in bounded steps (more).
TEST(RemovalLog, SliceOfOneNamespace) {
  RemovalLog log(100);
  auto key = [](int i) {
    std::string name = std::to_string(i);
    name.insert(name.begin(), 'k');
    return *Key::from_string(name);
  };
  for (int i = 1; i <= 10; ++i) log.add(i % 2 ? 1 : 2, key(i));  // odd seqs: ns 1, even: ns 2
  RemovalLog::Slice s = log.slice(0, 100, 2u);
  EXPECT_EQ(s.last, 10u);
  EXPECT_EQ(s.next, 10u);
  EXPECT_FALSE(s.lost);
  EXPECT_FALSE(s.more);
  ASSERT_EQ(s.records.size(), 5u);
  for (const auto& r : s.records) {
    EXPECT_EQ(r.nsid, 2u);
    EXPECT_EQ(r.seq % 2, 0u);
  }
  // At most 2 records: next stops before the third (past ns 2's seq 4), more follow.
  s = log.slice(0, 2, 1u);
  ASSERT_EQ(s.records.size(), 2u);
  EXPECT_EQ(s.records[1].seq, 3u);
  EXPECT_EQ(s.next, 4u);
  EXPECT_TRUE(s.more);
  // Bounded scan: 4 records looked at, 2 of them ns 1.
  s = log.slice(0, 100, 1u, 4);
  EXPECT_EQ(s.records.size(), 2u);
  EXPECT_EQ(s.next, 4u);
  EXPECT_TRUE(s.more);
  // Nothing of ns 3: the cursor still moves to the end.
  s = log.slice(4, 100, 3u);
  EXPECT_TRUE(s.records.empty());
  EXPECT_EQ(s.next, 10u);
  EXPECT_FALSE(s.more);
  // No cursor: the position only.
  s = log.slice(std::nullopt, 100, 1u);
  EXPECT_TRUE(s.records.empty());
  EXPECT_EQ(s.next, 10u);
  EXPECT_FALSE(s.lost);
  // Missed removals (nsid 0) make every namespace's reader lose track.
  log.add(0, Key{});
  log.add(2, key(12));
  s = log.slice(10, 100, 1u);
  EXPECT_TRUE(s.lost);
  EXPECT_TRUE(s.records.empty());
  EXPECT_EQ(s.next, 12u);
  s = log.slice(10, 100, 2u);
  EXPECT_TRUE(s.lost);
  ASSERT_EQ(s.records.size(), 1u);
  // A cursor of another life or one the log no longer holds.
  EXPECT_TRUE(log.slice(99, 100, 1u).lost);
  RemovalLog small(2);
  for (int i = 1; i <= 5; ++i) small.add(1, key(i));
  s = small.slice(1, 100, 1u);
  EXPECT_TRUE(s.lost);
  EXPECT_EQ(s.records.size(), 2u);
  EXPECT_EQ(s.first, 4u);
}

// Without a bind address the server listens on loopback only: /removed lists every namespace.
TEST(MetricsServerSetup, DefaultBindIsLoopback) {
  auto server = MetricsServer::start(0, [] { return MetricList{}; });
  ASSERT_TRUE(server) << server.error();
  const uint16_t port = (*server)->port();
  char want[16];
  std::snprintf(want, sizeof(want), "0100007F:%04X", port);  // 127.0.0.1, little-endian hex
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  bool found = false;
  while (std::getline(tcp, line)) {
    std::istringstream in(line);
    std::string sl, local;
    in >> sl >> local;
    if (local.size() > 5 && local.substr(local.size() - 5) == std::string(want + 8)) {
      EXPECT_EQ(local, want) << line;
      found = true;
    }
  }
  EXPECT_TRUE(found) << "port " << port << " not in /proc/net/tcp";
  EXPECT_TRUE(request(port, "GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200"));
}

TEST(MetricsServerSetup, PortInUseIsAClearError) {
  auto a = MetricsServer::start(
      0, [] { return MetricList{}; }, "127.0.0.1");
  ASSERT_TRUE(a) << a.error();
  auto b = MetricsServer::start((*a)->port(), [] { return MetricList{}; }, "127.0.0.1");
  ASSERT_FALSE(b) << "second server on one port";
  EXPECT_NE(b.error().find("cannot listen"), std::string::npos) << b.error();
  auto bad = MetricsServer::start(
      0, [] { return MetricList{}; }, "not-an-address");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("not an IPv4 address"), std::string::npos) << bad.error();
  // A source that throws gets a 500, and the server lives on.
  auto c = MetricsServer::start(
      0, []() -> MetricList { throw std::runtime_error("boom"); }, "127.0.0.1");
  ASSERT_TRUE(c) << c.error();
  EXPECT_TRUE(request(c->port(), "GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 500"));
  EXPECT_TRUE(request(c->port(), "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
}

TEST(CopyPeak, HostEngine) {
  auto engine = make_host_copy_engine();
  CopyPeakOptions o;
  o.bytes = 8 << 20;
  o.rounds = 2;
  const double bps = measure_copy_peak_bps(*engine, o);
  EXPECT_GT(bps, 1e8);  // any machine copies faster than 100 MB/s
  std::vector<std::byte> src(1 << 20, std::byte{1}), dst(1 << 20);
  o.bytes = src.size();
  o.src = src.data();
  o.dst = dst.data();
  EXPECT_GT(measure_copy_peak_bps(*engine, o), 0);
  EXPECT_EQ(dst[12345], std::byte{1});
  o.dst_kind = MemKind::kDevice;  // the host engine can't: reported as 0, not a crash
  EXPECT_EQ(measure_copy_peak_bps(*engine, o), 0);
}

}  // namespace
}  // namespace gdkv
