// gdkv._core's settings: Python dicts of settings by name applied to the C++ settings tables
// (gdkv/settings.h), and those tables as Python dicts (gdkv.settings, gdkv.effective_settings).
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <vector>

#include "gdkv/settings.h"

namespace gdkv_py {

namespace nb = nanobind;

// Settings by name, name -> value, applied to a default T through `table` (gdkv/settings.h;
// None keeps the default): an unknown name or a value of the wrong type raises TypeError, a value
// out of range ValueError. Defined for the store's table and a client's.
template <class T>
T to_settings(const std::vector<gdkv::Setting<T>>& table, const nb::dict& given);

// _core.effective_settings(given, kind): every row's value once `given` is applied to the
// defaults, as gdkv.open (kind "store") or gdkv.connect (kind "client") would open with them;
// refuses what they refuse, with their errors.
nb::dict effective_settings(const nb::dict& given, const std::string& kind);

// gdkv.settings(): every table, the store's, a client's and gdkvd's, each row a dict.
nb::list settings_table();

}  // namespace gdkv_py
