// Prometheus text exposition and the `gdkv stat` table.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string_view>
#include <unordered_map>

#include "gdkv/metrics_server.h"

namespace gdkv {
namespace {

constexpr std::string_view kPrefix = "gdkv_";

bool name_char(char c, bool first, bool colon) {
  const bool alpha =
      (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
  return alpha || (!first && c >= '0' && c <= '9');
}

std::string metric_name(const std::string& bare) {
  std::string n = bare.starts_with(kPrefix) ? bare : std::string(kPrefix) + bare;
  for (size_t i = 0; i < n.size(); ++i) {
    if (!name_char(n[i], i == 0, true)) n[i] = '_';
  }
  return n;
}

std::string label_name(const std::string& bare) {
  std::string n = bare.empty() ? std::string("_") : bare;
  for (size_t i = 0; i < n.size(); ++i) {
    if (!name_char(n[i], i == 0, false)) n[i] = '_';
  }
  return n;
}

void append_escaped(std::string& out, std::string_view s, bool quotes) {
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quotes) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// Samples grouped by exposed name, in order of first appearance (Prometheus wants one block per
// metric family).
std::vector<std::pair<std::string, std::vector<const Metric*>>> group(const MetricList& ms) {
  std::vector<std::pair<std::string, std::vector<const Metric*>>> groups;
  std::unordered_map<std::string, size_t> index;
  for (const Metric& m : ms) {
    std::string name = metric_name(m.name);
    auto [it, fresh] = index.try_emplace(name, groups.size());
    if (fresh) groups.emplace_back(std::move(name), std::vector<const Metric*>{});
    groups[it->second].second.push_back(&m);
  }
  return groups;
}

std::string labels_text(const Metric& m, bool braces) {
  std::string out;
  std::vector<std::string> seen;
  for (const auto& [k, v] : m.labels) {
    std::string name = label_name(k);
    if (std::find(seen.begin(), seen.end(), name) != seen.end()) continue;  // first one wins
    if (!out.empty()) out += ',';
    out += name;
    out += braces ? "=\"" : "=";
    append_escaped(out, v, braces);
    if (braces) out += '"';
    seen.push_back(std::move(name));
  }
  if (braces && !out.empty()) out = "{" + out + "}";
  return out;
}

}  // namespace

std::string prometheus_text(const MetricList& metrics) {
  std::string out;
  out.reserve(metrics.size() * 96);
  for (const auto& [name, samples] : group(metrics)) {
    const Metric& first = *samples.front();
    out += "# HELP ";
    out += name;
    out += ' ';
    append_escaped(out, first.help, false);
    out += "\n# TYPE ";
    out += name;
    out += first.type == MetricType::kCounter ? " counter\n" : " gauge\n";
    for (const Metric* m : samples) {
      out += name;
      out += labels_text(*m, true);
      out += ' ';
      out += format_value(m->value);
      out += '\n';
    }
  }
  return out;
}

std::string metrics_table(const MetricList& metrics) {
  struct Row {
    std::string name, labels, value;
  };
  std::vector<Row> rows;
  for (const auto& [name, samples] : group(metrics)) {
    for (const Metric* m : samples) {
      char buf[64];
      const double v = m->value;
      if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
        std::snprintf(buf, sizeof(buf), "%.0f", v);
      } else {
        std::snprintf(buf, sizeof(buf), "%.6g", v);
      }
      rows.push_back(Row{name, labels_text(*m, false), buf});
    }
  }
  size_t wn = 6, wl = 6;
  for (const Row& r : rows) {
    wn = std::max(wn, r.name.size());
    wl = std::max(wl, r.labels.size());
  }
  wn = std::min<size_t>(wn, 56);
  wl = std::min<size_t>(wl, 48);
  auto pad = [](std::string s, size_t w) {
    if (s.size() < w) s.append(w - s.size(), ' ');
    return s;
  };
  std::string out = pad("metric", wn) + "  " + pad("labels", wl) + "  value\n";
  for (const Row& r : rows)
    out += pad(r.name, wn) + "  " + pad(r.labels, wl) + "  " + r.value + "\n";
  return out;
}

}  // namespace gdkv
