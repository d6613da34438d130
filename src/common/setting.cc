// Setting rows (include/gdkv/setting.h): reading, setting and printing a value wherever it lives.
#include "gdkv/setting.h"

#include <cstdio>

namespace gdkv {

SettingValue SettingInfo::get_at(const void* p) const {
  switch (type) {
    case Type::kU16:
      return uint64_t{*static_cast<const uint16_t*>(p)};
    case Type::kU32:
      return uint64_t{*static_cast<const uint32_t*>(p)};
    case Type::kU64:
      return *static_cast<const uint64_t*>(p);
    case Type::kI32:
      return int64_t{*static_cast<const int32_t*>(p)};
    case Type::kBool:
      return *static_cast<const bool*>(p);
    case Type::kString:
      break;
  }
  return *static_cast<const std::string*>(p);
}

std::string SettingInfo::set_at(void* p, const SettingValue& v) const {
  if (is_integer()) {
    // Either kind of integer; min and max are within int64_t, so a uint64_t past it is out.
    int64_t n = 0;
    if (const uint64_t* u = std::get_if<uint64_t>(&v)) {
      if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return range_error();
      n = static_cast<int64_t>(*u);
    } else if (const int64_t* i = std::get_if<int64_t>(&v)) {
      n = *i;
    } else {
      return type_error();
    }
    if (n < min || n > max) return range_error();
    switch (type) {
      case Type::kU16:
        *static_cast<uint16_t*>(p) = static_cast<uint16_t>(n);
        break;
      case Type::kU32:
        *static_cast<uint32_t*>(p) = static_cast<uint32_t>(n);
        break;
      case Type::kU64:
        *static_cast<uint64_t*>(p) = static_cast<uint64_t>(n);
        break;
      default:
        *static_cast<int32_t*>(p) = static_cast<int32_t>(n);
    }
    return {};
  }
  if (type == Type::kBool) {
    const bool* b = std::get_if<bool>(&v);
    if (b == nullptr) return type_error();
    *static_cast<bool*>(p) = *b;
    return {};
  }
  const std::string* text = std::get_if<std::string>(&v);
  if (text == nullptr) return type_error();
  if (!choices.empty() && std::find(choices.begin(), choices.end(), *text) == choices.end()) {
    std::string all;
    for (const auto& c : choices) all += (all.empty() ? "" : ", ") + c;
    return "'" + *text + "' is not one of " + all;
  }
  *static_cast<std::string*>(p) = *text;
  return {};
}

const char* SettingInfo::type_error() const {
  switch (type) {
    case Type::kBool:
      return "must be true or false";
    case Type::kString:
      return "must be a string";
    default:
      return "must be an integer";
  }
}

std::string SettingInfo::range_error() const {
  if (std::string_view(unit) == "octal") {
    char text[48];
    std::snprintf(text, sizeof text, "must be in [0o%llo, 0o%llo]",
                  static_cast<unsigned long long>(min), static_cast<unsigned long long>(max));
    return text;
  }
  return "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string SettingInfo::text_at(const void* p) const {
  const SettingValue v = get_at(p);
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) {
    if (std::string_view(unit) == "octal") {  // as TOML writes it
      char text[32];
      std::snprintf(text, sizeof text, "0o%llo", static_cast<unsigned long long>(*n));
      return text;
    }
    return std::to_string(*n);
  }
  if (const int64_t* n = std::get_if<int64_t>(&v)) return std::to_string(*n);
  if (const bool* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return toml_string(std::get<std::string>(v));
}

std::string toml_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {  // a TOML \uXXXX escape
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(c));
      out += esc;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace gdkv
