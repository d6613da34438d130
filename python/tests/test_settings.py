"""The store's settings, declared once in C++ (include/gdkv/settings.h), against every front end
that reads them: gdkv.open, the connectors' config and LMCache's URL, gdkvd's flags and TOML,
and the table in docs/settings.md. (The C++ tests check gdkvd's TOML keys, flags and GDKVD_
variables one by one, and the CLI's flags: tools/gdkvd/config_test.cc, tests/cli_test.cc.)"""

from __future__ import annotations

import subprocess
import tomllib
from typing import Any

import pytest

import gdkv
from gdkv import engine, lmcache

from conftest import GDKVD, ROOT

SETTINGS = gdkv.settings()
TYPES = {"int": int, "bool": bool, "str": str}


def other_value(s: dict[str, Any]) -> Any:
    """A valid value that is not the default (as tests/setting_samples.h picks it)."""
    d = s["default"]
    if s["type"] == "int":
        return d + 1 if d < s["max"] else d - 1
    if s["type"] == "bool":
        return not d
    for c in s["choices"]:
        if c != d:
            return c
    return d + "-other" if d else "other"


def as_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_the_table_names_every_setting_once_with_a_valid_default():
    names = [s["name"] for s in SETTINGS]
    assert len(names) == len(set(names))
    assert {"backend", "store", "capacity", "ceph_timeout_ms", "cache_bytes", "cache_policy",
            "reactors", "max_value_bytes", "evict"} <= set(names)
    for s in SETTINGS:
        assert isinstance(s["default"], TYPES[s["type"]]), s
        if s["type"] == "int":
            assert s["min"] <= s["default"] <= s["max"], s
        if s["type"] == "str" and s["choices"]:
            assert s["default"] in s["choices"], s
    by_name = {s["name"]: s for s in SETTINGS}
    assert by_name["ceph_timeout_ms"]["default"] == 5000
    assert by_name["cache_policy"]["default"] == "adaptive"
    assert by_name["backend"]["toml"] == "backend.kind"


@pytest.mark.parametrize("s", SETTINGS, ids=[s["name"] for s in SETTINGS])
def test_gdkv_open_takes_each_setting_and_refuses_bad_values(s):
    name = s["name"]

    def open_with(value: Any) -> gdkv.Client:
        return gdkv.open(value) if name == "backend" else gdkv.open("memory", **{name: value})

    with open_with(other_value(s)) as c:  # the backend: memory
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"
    # The settings gdkv.open builds from its keywords (the same conversion) hold the value.
    assert gdkv._core.effective_settings({name: other_value(s)})[name] == other_value(s)
    with pytest.raises(TypeError, match=name):
        open_with("1" if s["type"] != "str" else 1)
    if s["type"] == "int":
        if s["min"] > 0:
            with pytest.raises(ValueError, match=rf"{name}: must be in \[{s['min']}, "):
                open_with(s["min"] - 1)
        with pytest.raises(ValueError, match=name):
            open_with(s["max"] + 1)
    if s["type"] == "str" and s["choices"]:
        with pytest.raises(ValueError, match="'nope' is not one of"):
            open_with("nope")


def test_gdkv_open_refuses_an_unknown_setting_and_none_keeps_the_default():
    with pytest.raises(TypeError, match="unknown setting 'cache_byte'"):
        gdkv.open("memory", cache_byte=1 << 20)
    with pytest.raises(TypeError, match="unknown setting 'op_timeout_ms'"):
        gdkv.open("memory", op_timeout_ms=1000)
    with gdkv.open("memory", store=None, cache_bytes=None) as c:
        assert "memory backend" in repr(c)


def test_the_connectors_read_every_setting_with_its_type():
    for s in SETTINGS:
        assert engine.STORE_SETTINGS[s["name"]] is TYPES[s["type"]], s["name"]
    config = {s["name"]: other_value(s) for s in SETTINGS}
    assert engine.read_config(config, {}, "a test config") == config
    with pytest.raises(ValueError, match="'ceph_timeout'"):
        engine.read_config({"ceph_timeout": 1}, {}, "a test config")
    # LMCache's URL: every setting as a query option, converted to its type.
    query = "&".join(f"{s['name']}={as_text(other_value(s))}" for s in SETTINGS
                     if s["name"] != "backend")
    parsed = lmcache.parse_url("gdkv://?backend=memory&" + query)
    for s in SETTINGS:
        if s["name"] != "backend":
            assert parsed[s["name"]] == other_value(s), s["name"]
    with pytest.raises(ValueError, match="evict=.*not true or false"):
        lmcache.parse_url("gdkv://?backend=memory&evict=maybe")


def test_a_connector_config_is_read_with_its_types():
    """One reader for every connector's config: JSON values and text (a URL's query) give the
    same settings; a value of the wrong type, or below a key's least value, names its key;
    None keeps the default."""
    own = {"threads": (int, 1), "label": None}
    text = {"nsid": "2", "retry_interval_s": "0.5", "evict": "false", "threads": "3",
            "label": 7, "namespace": None}
    typed = {"nsid": 2, "retry_interval_s": 0.5, "evict": False, "threads": 3, "label": 7}
    assert engine.read_config(text, own, "a test config") == typed
    assert engine.read_config(typed, own, "a test config") == typed
    for key, bad, why in [("nsid", True, "not an integer"), ("nsid", 1.5, "not an integer"),
                          ("nsid", "one", "invalid literal"), ("evict", "maybe", "true or false"),
                          ("timeout_ms", [1], ""), ("threads", "0", "at least 1"),
                          ("timeout_ms", 0, "at least 1")]:
        with pytest.raises(ValueError, match=f"gdkv: {key}=.* in a test config: .*{why}"):
            engine.read_config({key: bad}, own, "a test config")


def test_gdkvd_takes_every_flag_and_prints_every_key():
    args = [str(GDKVD), "--check-config"]
    for s in SETTINGS:
        v = other_value(s)
        if s["type"] == "bool":
            args.append(s["flag"] if v else "--no-" + s["flag"][2:])
        else:
            args += [s["flag"], as_text(v)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    printed = tomllib.loads(out.stdout)
    for s in SETTINGS:
        table, key = s["toml"].split(".")
        assert printed[table][key] == other_value(s), s["toml"]


def doc_table() -> str:
    """docs/settings.md's table, as the settings table gives it."""
    rows = ["| setting | gdkvd TOML | flag | type | default | accepted | meaning |",
            "|---|---|---|---|---|---|---|"]
    for s in SETTINGS:
        if s["type"] == "int":
            accepted = f"{s['min']}..{s['max']}"
        elif s["type"] == "str" and s["choices"]:
            accepted = ", ".join(s["choices"])
        else:
            accepted = ""
        default = as_text(s["default"]) if s["type"] != "str" else f'"{s["default"]}"'
        unit = f" ({s['unit']})" if s["unit"] else ""
        rows.append(f"| `{s['name']}` | `{s['toml']}` | `{s['flag']}` | {s['type']}{unit} | "
                    f"`{default}` | {accepted} | {s['help']} |")
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_the_settings_table():
    text = (ROOT / "docs" / "settings.md").read_text()
    begin, end = "<!-- settings table -->\n", "<!-- end of the settings table -->"
    assert begin in text and end in text
    documented = text[text.index(begin) + len(begin):text.index(end)]
    assert documented == doc_table(), "docs/settings.md's table should read:\n" + doc_table()
