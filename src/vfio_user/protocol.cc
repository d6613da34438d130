// vfio-user wire format: header checks, VERSION capabilities, and a small bounded JSON parser.
#include "vfio_user/protocol.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace gdkv::vfio_user {

const char* cmd_name(uint16_t cmd) noexcept {
  switch (static_cast<Cmd>(cmd)) {
    case Cmd::kVersion:
      return "VERSION";
    case Cmd::kDmaMap:
      return "DMA_MAP";
    case Cmd::kDmaUnmap:
      return "DMA_UNMAP";
    case Cmd::kDeviceGetInfo:
      return "DEVICE_GET_INFO";
    case Cmd::kDeviceGetRegionInfo:
      return "DEVICE_GET_REGION_INFO";
    case Cmd::kDeviceGetRegionIoFds:
      return "DEVICE_GET_REGION_IO_FDS";
    case Cmd::kDeviceGetIrqInfo:
      return "DEVICE_GET_IRQ_INFO";
    case Cmd::kDeviceSetIrqs:
      return "DEVICE_SET_IRQS";
    case Cmd::kRegionRead:
      return "REGION_READ";
    case Cmd::kRegionWrite:
      return "REGION_WRITE";
    case Cmd::kDmaRead:
      return "DMA_READ";
    case Cmd::kDmaWrite:
      return "DMA_WRITE";
    case Cmd::kDeviceReset:
      return "DEVICE_RESET";
    case Cmd::kRegionWriteMulti:
      return "REGION_WRITE_MULTI";
    case Cmd::kDeviceFeature:
      return "DEVICE_FEATURE";
    case Cmd::kMigDataRead:
      return "MIG_DATA_READ";
    case Cmd::kMigDataWrite:
      return "MIG_DATA_WRITE";
  }
  return "unknown";
}

HeaderError check_header(const Header& h, uint32_t max_size) noexcept {
  if (h.size < sizeof(Header)) return HeaderError::kTooShort;
  if (h.size > max_size) return HeaderError::kTooLarge;
  const uint32_t type = h.flags & kTypeMask;
  if (type != kTypeCommand && type != kTypeReply) return HeaderError::kBadType;
  return HeaderError::kOk;
}

// ---- JSON --------------------------------------------------------------------------------------

const JsonValue* JsonValue::find(std::string_view key) const {
  if (type != Type::kObject) return nullptr;
  for (size_t i = 0; i < keys.size() && i < items.size(); ++i) {
    if (keys[i] == key) return &items[i];
  }
  return nullptr;
}

namespace {

class JsonParser {
 public:
  JsonParser(std::string_view s, int max_depth) : s_(s), max_depth_(max_depth) {}

  std::optional<JsonValue> parse_document() {
    JsonValue v;
    skip_ws();
    if (!value(v, 0)) return std::nullopt;
    skip_ws();
    if (pos_ != s_.size()) return std::nullopt;
    return v;
  }

 private:
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  bool value(JsonValue& v, int depth) {
    if (depth > max_depth_ || pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '{') return object(v, depth);
    if (c == '[') return array(v, depth);
    if (c == '"') {
      v.type = JsonValue::Type::kString;
      return string(v.str);
    }
    if (c == 't') {
      v.type = JsonValue::Type::kBool;
      v.b = true;
      return literal("true");
    }
    if (c == 'f') {
      v.type = JsonValue::Type::kBool;
      v.b = false;
      return literal("false");
    }
    if (c == 'n') {
      v.type = JsonValue::Type::kNull;
      return literal("null");
    }
    return number(v);
  }

  bool object(JsonValue& v, int depth) {
    v.type = JsonValue::Type::kObject;
    ++pos_;  // '{'
    skip_ws();
    if (eat('}')) return true;
    for (;;) {
      skip_ws();
      std::string key;
      if (pos_ >= s_.size() || s_[pos_] != '"' || !string(key)) return false;
      skip_ws();
      if (!eat(':')) return false;
      skip_ws();
      JsonValue member;
      if (!value(member, depth + 1)) return false;
      v.keys.push_back(std::move(key));
      v.items.push_back(std::move(member));
      skip_ws();
      if (eat('}')) return true;
      if (!eat(',')) return false;
    }
  }

  bool array(JsonValue& v, int depth) {
    v.type = JsonValue::Type::kArray;
    ++pos_;  // '['
    skip_ws();
    if (eat(']')) return true;
    for (;;) {
      skip_ws();
      JsonValue item;
      if (!value(item, depth + 1)) return false;
      v.items.push_back(std::move(item));
      skip_ws();
      if (eat(']')) return true;
      if (!eat(',')) return false;
    }
  }

  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  bool hex4(uint32_t* out) {
    if (s_.size() - pos_ < 4) return false;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const int d = hex_digit(s_[pos_ + i]);
      if (d < 0) return false;
      v = (v << 4) | static_cast<uint32_t>(d);
    }
    pos_ += 4;
    *out = v;
    return true;
  }
  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool string(std::string& out) {
    ++pos_;  // opening quote
    while (pos_ < s_.size()) {
      const char c = s_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;  // control characters must be escaped
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return false;
      const char e = s_[pos_++];
      switch (e) {
        case '"':
          out.push_back('"');
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '/':
          out.push_back('/');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'u': {
          uint32_t cp;
          if (!hex4(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t lo;
            if (!literal("\\u") || !hex4(&lo) || lo < 0xDC00 || lo > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;  // a lone low surrogate
          }
          put_utf8(out, cp);
          break;
        }
        default:
          return false;
      }
    }
    return false;  // unterminated
  }

  bool number(JsonValue& v) {
    const size_t start = pos_;
    bool negative = false, fraction = false;
    if (eat('-')) negative = true;
    if (pos_ >= s_.size()) return false;
    if (s_[pos_] == '0') {
      ++pos_;
    } else if (s_[pos_] >= '1' && s_[pos_] <= '9') {
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    } else {
      return false;
    }
    if (eat('.')) {
      fraction = true;
      const size_t digits = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return false;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      fraction = true;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      const size_t digits = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return false;
    }
    const std::string_view text = s_.substr(start, pos_ - start);
    if (text.size() > 64) return false;  // no capability needs more digits than this
    v.type = JsonValue::Type::kNumber;
    const std::string copy(text);
    v.num = std::strtod(copy.c_str(), nullptr);
    if (!negative && !fraction) {
      uint64_t u = 0;
      bool overflow = false;
      for (char c : text) {
        const uint64_t d = static_cast<uint64_t>(c - '0');
        if (u > (UINT64_MAX - d) / 10) {
          overflow = true;
          break;
        }
        u = u * 10 + d;
      }
      v.is_uint = !overflow;
      v.u = overflow ? 0 : u;
    }
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
  int max_depth_;
};

// Reads an unsigned integer capability: absent is fine, present must be a non-negative integer.
bool read_uint(const JsonValue& obj, std::string_view key, std::optional<uint64_t>* out) {
  const JsonValue* v = obj.find(key);
  if (v == nullptr) return true;
  if (v->type != JsonValue::Type::kNumber || !v->is_uint) return false;
  *out = v->u;
  return true;
}

}  // namespace

std::optional<JsonValue> parse_json(std::string_view text, int max_depth) {
  return JsonParser(text, max_depth).parse_document();
}

int decode_version(std::span<const std::byte> payload, VersionRequest* out) {
  PayloadReader r(payload);
  auto v = r.get<VersionMsg>();
  if (!v) return EINVAL;
  out->major = v->major;
  out->minor = v->minor;
  out->caps = Capabilities{};
  std::span<const std::byte> rest = r.tail(sizeof(VersionMsg));
  if (rest.empty()) return 0;
  // The JSON ends at its NUL; a payload without one is not a C string and is refused.
  const auto* chars = reinterpret_cast<const char*>(rest.data());
  const auto* nul = static_cast<const char*>(std::memchr(chars, '\0', rest.size()));
  if (nul == nullptr) return EINVAL;
  const std::string_view text(chars, static_cast<size_t>(nul - chars));
  if (text.size() > kMaxVersionJson) return EINVAL;
  // Some clients pad with a bare NUL; an empty document proposes nothing.
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) return 0;
  std::optional<JsonValue> doc = parse_json(text);
  if (!doc || doc->type != JsonValue::Type::kObject) return EINVAL;
  out->caps.has_json = true;
  const JsonValue* caps = doc->find("capabilities");
  if (caps == nullptr) return 0;
  if (caps->type != JsonValue::Type::kObject) return EINVAL;
  Capabilities& c = out->caps;
  if (!read_uint(*caps, "max_msg_fds", &c.max_msg_fds) ||
      !read_uint(*caps, "max_data_xfer_size", &c.max_data_xfer_size) ||
      !read_uint(*caps, "max_dma_maps", &c.max_dma_maps) ||
      !read_uint(*caps, "pgsizes", &c.pgsizes)) {
    return EINVAL;
  }
  if (const JsonValue* w = caps->find("write_multiple")) {
    if (w->type != JsonValue::Type::kBool) return EINVAL;
    c.write_multiple = w->b;
  }
  if (const JsonValue* t = caps->find("twin_socket")) {
    if (t->type != JsonValue::Type::kObject) return EINVAL;
    if (const JsonValue* s = t->find("supported")) {
      if (s->type != JsonValue::Type::kBool) return EINVAL;
      c.twin_socket = s->b;
    }
  }
  if (const JsonValue* m = caps->find("migration")) {
    if (m->type != JsonValue::Type::kObject) return EINVAL;
    c.migration = true;
  }
  return 0;
}

std::string version_reply_json(const Capabilities& proposed, uint32_t max_dma_maps) {
  std::string out = "{\"capabilities\":{";
  bool first = true;
  auto add = [&](const char* key, const std::string& value) {
    if (!first) out += ',';
    first = false;
    out += '"';
    out += key;
    out += "\":";
    out += value;
  };
  if (proposed.max_msg_fds) add("max_msg_fds", std::to_string(kMaxMsgFds));
  if (proposed.max_data_xfer_size) add("max_data_xfer_size", std::to_string(kMaxDataXfer));
  if (proposed.pgsizes) add("pgsizes", "4096");
  if (proposed.max_dma_maps) {
    add("max_dma_maps", std::to_string(std::min<uint64_t>(*proposed.max_dma_maps, max_dma_maps)));
  }
  // We accept REGION_WRITE_MULTI; twin sockets and migration we do not offer.
  if (proposed.write_multiple) add("write_multiple", *proposed.write_multiple ? "true" : "false");
  if (proposed.twin_socket) add("twin_socket", "{\"supported\":false}");
  out += "}}";
  return out;
}

}  // namespace gdkv::vfio_user
