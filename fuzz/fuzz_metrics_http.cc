// libFuzzer target: the metrics server's request parsing (http_answer, metrics_http.h).
//
// Input: the bytes a client sends; the head is what comes before the first blank line (CRLF CRLF
// or LF LF), at most 8 KiB, as the server cuts it. It is answered against a removal log holding
// five records and a metrics source of two samples. Properties checked: the status is one the
// server sends, a HEAD request's answer says head_only, and a 200 from /removed is the log's JSON.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "gdkv/key.h"
#include "gdkv/metrics.h"
#include "metrics/metrics_http.h"

using namespace gdkv;  // NOLINT

namespace {

const RemovalLog& removals() {
  static RemovalLog* log = [] {
    auto* l = new RemovalLog(4);
    for (const char* k : {"a", "bb", "ccc", "dddd", "eeeee"}) l->add(1, *Key::from_string(k));
    return l;
  }();
  return *log;
}

MetricList source() {
  MetricList m;
  m.push_back(Metric{"ops_total", "ops served", MetricType::kCounter, {{"op", "get"}}, 3});
  m.push_back(Metric{"bytes", "bytes held", MetricType::kGauge, {}, 4096});
  return m;
}

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t end = std::min(in.find("\r\n\r\n"), in.find("\n\n"));
  if (end == std::string_view::npos || end > 8192) return 0;
  const std::string_view head = in.substr(0, end);
  const HttpAnswer a = http_answer(head, source, &removals());
  const std::string_view code = std::string_view(a.status).substr(0, 3);
  check(code == "200" || code == "400" || code == "404" || code == "405");
  if (head.starts_with("HEAD ") && code != "400") check(a.head_only);
  if (code == "200" && a.type == "application/json") {
    check(a.body.starts_with("{\"boot\": ") && a.body.ends_with("]}\n"));
  }
  if (code == "200" && a.type != "application/json") {
    check(a.body.find("gdkv_ops_total{op=\"get\"} 3\n") != std::string::npos);
  }
  return 0;
}
