// Setting rows (include/gdkv/setting.h): reading, setting and printing a value wherever it lives.
#include "gdkv/setting.h"

#include <cstdio>
#include <stdexcept>

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
    case Type::kIdList: {
      std::string text;
      for (const uint32_t id : *static_cast<const std::vector<uint32_t>*>(p)) {
        if (!text.empty()) text += ':';
        text += std::to_string(id);
      }
      return text;
    }
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
  if (type == Type::kIdList) {
    std::vector<uint32_t> ids;
    for (size_t at = 0; at < text->size();) {
      const size_t end = std::min(text->find(':', at), text->size());
      const std::string id = text->substr(at, end - at);
      const bool digits =
          !id.empty() && id.size() <= 10 && id.find_first_not_of("0123456789") == std::string::npos;
      if (!digits || std::stoull(id) > std::numeric_limits<uint32_t>::max()) return type_error();
      ids.push_back(static_cast<uint32_t>(std::stoull(id)));
      at = end + 1;
      if (end + 1 == text->size()) return type_error();  // a trailing ':'
    }
    *static_cast<std::vector<uint32_t>*>(p) = std::move(ids);
    return {};
  }
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
    case Type::kIdList:
      return "must be a list of ids in [0, 4294967295]";
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
  if (type == Type::kIdList) {
    std::string list = "[";
    for (const uint32_t id : *static_cast<const std::vector<uint32_t>*>(p)) {
      if (list.size() > 1) list += ", ";
      list += std::to_string(id);
    }
    return list + "]";
  }
  return toml_string(std::get<std::string>(v));
}

std::string SettingInfo::parse_at(void* p, const std::string& text) const {
  if (type == Type::kBool) {
    if (text != "true" && text != "false") return type_error();
    return set_at(p, text == "true");
  }
  if (!is_integer()) return set_at(p, text);
  const bool octal = std::string_view(unit) == "octal";
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(text, &used, octal ? 8 : 10);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) return octal ? "not octal permissions" : type_error();
  return set_at(p, int64_t{n});
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
