// KV-cache request traces in the Mooncake format (kvcache-ai/Mooncake, FAST'25 trace release),
// for the trace benchmark (bench/cache/trace_bench.cc) to replay: JSON Lines, one request a line,
//   {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, ...]}
// `hash_ids` are the request's prompt blocks in chain order (equal ids: the same KV block).
//
// The reader is strict, so a damaged or truncated file is an error and not a silently different
// benchmark: each line must be one JSON object (RFC 8259 syntax, nesting at most 64 deep) with a
// numeric `timestamp` and `hash_ids`, an array of integers in 0..2^64-1; `input_length` and
// `output_length`, when present, are integers in the same range; other members are skipped; no
// member may appear twice. Blank lines are skipped; a file without any request is an error.
// Errors are std::runtime_error "FILE:LINE: what" (or "FILE: what" for the file as a whole).
#pragma once

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace gdkv::cache {

struct TraceRequest {
  double timestamp = 0;
  std::vector<uint64_t> hash_ids;  // chain order
};

// Requests with their blocks renumbered densely (0..unique_blocks-1, in order of first use), so a
// simulator can index arrays by block.
struct BlockTrace {
  std::vector<uint64_t> refs;    // block ids, request after request
  std::vector<uint64_t> starts;  // where each request begins in refs, plus refs.size() at the end
  uint64_t unique_blocks = 0;
  uint64_t requests() const { return starts.empty() ? 0 : starts.size() - 1; }
};

namespace trace_detail {

class LineParser {
 public:
  explicit LineParser(std::string_view s) : s_(s) {}

  // Parses the whole line into `out`; false with `error` set when it is not a valid request.
  bool request(TraceRequest* out, std::string* error) {
    try {
      parse_request(out);
      return true;
    } catch (const Error& e) {
      *error = e.what;
      return false;
    }
  }

 private:
  struct Error {
    std::string what;
  };
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error{what + " at column " + std::to_string(pos_ + 1)};
  }
  void ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\r' || s_[pos_] == '\n')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    ws();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  char peek() {
    ws();
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }

  std::string string() {
    ws();
    if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string");
    ++pos_;
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          out += ' ';  // member names only need to compare; these never occur in ours
          break;
        case 'u':
          for (int i = 0; i < 4; ++i, ++pos_) {
            if (pos_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[pos_]))) {
              fail("bad \\u escape");
            }
          }
          out += '?';
          break;
        default:
          --pos_;
          fail("bad escape");
      }
    }
  }

  // A JSON number's text (validated against the grammar); `integral` says it has no fraction or
  // exponent.
  std::string_view number(bool* integral) {
    ws();
    const size_t begin = pos_;
    auto digits = [&] {
      const size_t d = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - d;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    const size_t int_begin = pos_;
    const size_t n = digits();
    if (n == 0) fail("expected a number");
    if (n > 1 && s_[int_begin] == '0') {
      pos_ = int_begin;
      fail("leading zero in a number");
    }
    *integral = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      *integral = false;
      if (digits() == 0) fail("expected digits after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      *integral = false;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("expected digits in the exponent");
    }
    return s_.substr(begin, pos_ - begin);
  }

  uint64_t unsigned_integer(const char* what) {
    const size_t at = (ws(), pos_);
    bool integral = false;
    const std::string_view t = number(&integral);
    if (!integral || t[0] == '-') {
      pos_ = at;
      fail(std::string(what) + " must be an integer in 0..2^64-1, not " + std::string(t));
    }
    uint64_t v = 0;
    for (char c : t) {
      const uint64_t d = static_cast<uint64_t>(c - '0');
      if (v > (UINT64_MAX - d) / 10) {
        pos_ = at;
        fail(std::string(what) + " out of range (over 2^64-1): " + std::string(t));
      }
      v = v * 10 + d;
    }
    return v;
  }

  double real(const char* what) {
    const size_t at = (ws(), pos_);
    bool integral = false;
    const std::string t(number(&integral));
    errno = 0;
    const double v = std::strtod(t.c_str(), nullptr);
    if (errno == ERANGE && std::isinf(v)) {
      pos_ = at;
      fail(std::string(what) + " out of range: " + t);
    }
    return v;
  }

  void literal(std::string_view word) {
    ws();
    if (s_.substr(pos_, word.size()) != word) fail("expected a JSON value");
    pos_ += word.size();
  }

  // Any JSON value, checked and dropped.
  void skip_value(int depth) {
    if (depth > kMaxDepth) fail("nested too deeply");
    const char c = peek();
    if (c == '{') {
      ++pos_;
      if (eat('}')) return;
      do {
        string();
        expect(':');
        skip_value(depth + 1);
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++pos_;
      if (eat(']')) return;
      do {
        skip_value(depth + 1);
      } while (eat(','));
      expect(']');
    } else if (c == '"') {
      string();
    } else if (c == 't') {
      literal("true");
    } else if (c == 'f') {
      literal("false");
    } else if (c == 'n') {
      literal("null");
    } else {
      bool integral;
      number(&integral);
    }
  }

  void parse_request(TraceRequest* out) {
    *out = TraceRequest{};
    bool seen_ts = false, seen_ids = false, seen_in = false, seen_out = false;
    auto once = [&](bool* seen, const std::string& name) {
      if (*seen) fail("duplicate member \"" + name + "\"");
      *seen = true;
    };
    expect('{');
    if (!eat('}')) {
      do {
        const std::string name = string();
        expect(':');
        if (name == "timestamp") {
          once(&seen_ts, name);
          out->timestamp = real("timestamp");
        } else if (name == "hash_ids") {
          once(&seen_ids, name);
          expect('[');
          if (!eat(']')) {
            do {
              out->hash_ids.push_back(unsigned_integer("a hash id"));
            } while (eat(','));
            expect(']');
          }
        } else if (name == "input_length") {
          once(&seen_in, name);
          unsigned_integer("input_length");
        } else if (name == "output_length") {
          once(&seen_out, name);
          unsigned_integer("output_length");
        } else {
          skip_value(1);
        }
      } while (eat(','));
      expect('}');
    }
    ws();
    if (pos_ != s_.size()) fail("text after the object");
    if (!seen_ids) throw Error{"missing member \"hash_ids\""};
    if (!seen_ts) throw Error{"missing member \"timestamp\""};
  }

  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace trace_detail

// One line of a Mooncake trace; false with `error` ("what at column N") when it is malformed.
inline bool parse_mooncake_line(std::string_view line, TraceRequest* out, std::string* error) {
  return trace_detail::LineParser(line).request(out, error);
}

// A whole trace from a stream; `name` prefixes errors ("name:line: what").
inline BlockTrace read_mooncake_trace(std::istream& in, const std::string& name) {
  BlockTrace t;
  std::unordered_map<uint64_t, uint64_t> dense;
  std::string line, error;
  TraceRequest r;
  uint64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!parse_mooncake_line(line, &r, &error)) {
      throw std::runtime_error(name + ":" + std::to_string(lineno) + ": " + error);
    }
    t.starts.push_back(t.refs.size());
    for (uint64_t id : r.hash_ids) {
      t.refs.push_back(dense.try_emplace(id, dense.size()).first->second);
    }
  }
  if (in.bad()) throw std::runtime_error(name + ": read error");
  if (t.starts.empty()) throw std::runtime_error(name + ": no requests (empty trace)");
  t.starts.push_back(t.refs.size());
  t.unique_blocks = dense.size();
  return t;
}

inline BlockTrace read_mooncake_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  return read_mooncake_trace(in, path);
}

}  // namespace gdkv::cache
