// gdkv._core's keys from Python: a key (bytes or str of 1..16 bytes), a list of keys, bytes-or-str
// text (a prefix, a salt), and token ids (chain_keys).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gdkv/key.h"

namespace gdkv_py {

namespace nb = nanobind;

// The bytes of a bytes object or a str (UTF-8); TypeError naming `what` otherwise.
std::string bytes_or_str(nb::handle h, const char* what);

// bytes, bytearray or str (UTF-8) of 1..16 bytes.
gdkv::Key to_key(nb::handle h);

std::vector<gdkv::Key> to_keys(nb::handle seq);

// Ints in [0, 2**32).
std::vector<uint32_t> to_tokens(nb::handle tokens);

}  // namespace gdkv_py
