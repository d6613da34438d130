// gdkv._core's settings: to_settings, and the tables' rows and values as Python objects.
#include "settings.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <variant>

#include "errors.h"

namespace gdkv_py {

template <class T>
T to_settings(const std::vector<gdkv::Setting<T>>& table, const nb::dict& given) {
  T s;
  for (auto [k, v] : given) {
    const std::string name = nb::cast<std::string>(k);
    const gdkv::Setting<T>* x = gdkv::find_setting(table, name);
    if (x == nullptr) raise_type("unknown setting '" + name + "' (gdkv.settings() lists them)");
    if (v.is_none()) continue;
    gdkv::SettingValue value;
    switch (x->type) {
      case gdkv::SettingInfo::Type::kBool:
        if (!PyBool_Check(v.ptr())) raise_type(name + " is a bool, not " + py_type_name(v));
        value = v.ptr() == Py_True;
        break;
      case gdkv::SettingInfo::Type::kString:
        if (!PyUnicode_Check(v.ptr())) raise_type(name + " is a str, not " + py_type_name(v));
        value = nb::cast<std::string>(v);
        break;
      default: {
        if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) {
          raise_type(name + " is an int, not " + py_type_name(v));
        }
        const long long n = PyLong_AsLongLong(v.ptr());
        if (n == -1 && PyErr_Occurred()) {
          PyErr_Clear();  // past 64 bits
          raise_value(name + ": " + x->range_error());
        }
        value = int64_t{n};
      }
    }
    if (const std::string err = x->set(s, value); !err.empty()) raise_value(name + ": " + err);
  }
  return s;
}

// gdkv.open's and gdkv.connect's (core.cc).
template gdkv::StoreSettings to_settings(const std::vector<gdkv::Setting<gdkv::StoreSettings>>&,
                                         const nb::dict&);
template gdkv::VfioUserClientOptions to_settings(
    const std::vector<gdkv::Setting<gdkv::VfioUserClientOptions>>&, const nb::dict&);

namespace {

// A setting's value as Python holds it.
nb::object setting_value(const gdkv::SettingValue& v) {
  if (const uint64_t* n = std::get_if<uint64_t>(&v)) return nb::int_(*n);
  if (const int64_t* n = std::get_if<int64_t>(&v)) return nb::int_(*n);
  if (const bool* b = std::get_if<bool>(&v)) return nb::bool_(*b);
  return nb::str(std::get<std::string>(v).c_str());
}

// Every row's value once `given` is applied to the defaults, as gdkv.open or gdkv.connect would
// open with them; refuses what they refuse, with their errors.
template <class T>
nb::dict effective(const std::vector<gdkv::Setting<T>>& table, const nb::dict& given) {
  const T s = to_settings(table, given);
  nb::dict out;
  for (const gdkv::Setting<T>& x : table) out[x.name] = setting_value(x.get(s));
  return out;
}

// The rows of `table` as dicts, each with its default (a default T's value) and `kind`.
template <class T>
void describe(const std::vector<gdkv::Setting<T>>& table, const char* kind, nb::list& out) {
  const T defaults;
  for (const gdkv::Setting<T>& x : table) {
    nb::dict d;
    d["name"] = x.name;
    d["kind"] = kind;
    d["toml"] = x.toml;
    d["flag"] = x.flag;
    d["default"] = setting_value(x.get(defaults));
    if (x.is_integer()) {
      d["type"] = "int";
      d["min"] = x.min;
      d["max"] = x.max;
    } else if (x.type == gdkv::SettingInfo::Type::kBool) {
      d["type"] = "bool";
    } else if (x.type == gdkv::SettingInfo::Type::kIdList) {
      d["type"] = "list";  // of ids; the value is text with ':' between them
      nb::list ids;
      const std::string text = std::get<std::string>(x.get(defaults));
      for (size_t at = 0; at < text.size();) {
        const size_t end = std::min(text.find(':', at), text.size());
        ids.append(nb::int_(std::stoull(text.substr(at, end - at))));
        at = end + 1;
      }
      d["default"] = ids;
    } else {
      d["type"] = "str";
      d["choices"] = x.choices;
    }
    d["unit"] = x.unit;
    d["help"] = x.help;
    out.append(d);
  }
}

}  // namespace

nb::dict effective_settings(const nb::dict& given, const std::string& kind) {
  if (kind == "client") return effective(gdkv::client_settings(), given);
  if (kind != "store") raise_value("kind is store or client, not '" + kind + "'");
  return effective(gdkv::store_settings(), given);
}

nb::list settings_table() {
  nb::list out;
  describe(gdkv::store_settings(), "store", out);
  describe(gdkv::client_settings(), "client", out);
  describe(gdkv::daemon_settings(), "daemon", out);
  describe(gdkv::namespace_settings(), "namespace", out);
  return out;
}

}  // namespace gdkv_py
