// The metrics server's answer to one request, apart from its sockets (metrics_server.cc; the
// fuzz target fuzz_metrics_http calls it directly).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "gdkv/metrics_server.h"

namespace gdkv {

struct HttpAnswer {
  std::string status;  // "200 OK", "400 Bad Request", ...
  std::string body;
  bool head_only = false;  // a HEAD request: the headers alone are sent
  std::string extra;       // further header lines, each ending in CRLF
  std::string type = "text/plain; charset=utf-8";
};

// `head`: the request line and headers, without the blank line that ends them. GET or HEAD of
// /metrics (source() as Prometheus text) or /removed[?after=SEQ] (when removals is not null);
// anything else is answered 400, 404 or 405.
HttpAnswer http_answer(std::string_view head, const std::function<MetricList()>& source,
                       const RemovalLog* removals);

}  // namespace gdkv
