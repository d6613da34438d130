"""gdkv's settings, declared once (the C++ tables in include/gdkv/settings.h; the connectors' keys
in gdkv.config), against every front end that reads them: gdkv.open, gdkv.connect, the
connectors' config and LMCache's URL, gdkvd's flags and TOML, and the tables in
docs/settings.md. (The C++ tests check gdkvd's TOML keys, flags and GDKVD_
variables one by one, and the CLI's flags: tools/gdkvd/config_test.cc, tests/cli_test.cc.)"""

from __future__ import annotations

import subprocess
import tomllib
from typing import Any

import pytest

import gdkv
from gdkv import config as gconfig
from gdkv import lmcache

from conftest import GDKVD, ROOT

SETTINGS = gdkv.settings("store")
CLIENT = gdkv.settings("client")
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
def test_gdkv_open_takes_each_setting_and_refuses_bad_values(s, tmp_path):
    name = s["name"]

    def open_with(value: Any) -> gdkv.Client:
        if name != "backend":
            return gdkv.open("memory", **{name: value})
        # A backend that keeps its values in a directory of its own is given one.
        traits = gdkv.backend_traits().get(value, {})
        where = traits.get("directory_setting")
        return gdkv.open(value, **({where: str(tmp_path / "dir")} if where and where != "store"
                                   else {}))

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
    for s in SETTINGS + CLIENT:
        if s["name"] == "backend":   # a connector's: none unless given (gdkvd serves it)
            continue
        key = gconfig.keys_by_name(gconfig.STORE_KEYS, gconfig.ENGINE_KEYS)[s["name"]]
        assert key.type is TYPES[s["type"]] and key.default == s["default"], s["name"]
    config = {s["name"]: other_value(s) for s in SETTINGS + CLIENT}
    read = gconfig.read_config(config, [], "a test config")
    assert {k: read[k] for k in config} == config
    with pytest.raises(ValueError, match="'ceph_timeout'"):
        gconfig.read_config({"ceph_timeout": 1}, [], "a test config")
    # LMCache's URL: every setting as a query option, converted to its type.
    query = "&".join(f"{s['name']}={as_text(other_value(s))}" for s in SETTINGS + CLIENT
                     if s["name"] != "backend")
    parsed = lmcache.parse_url("gdkv://?backend=memory&" + query)
    for s in SETTINGS + CLIENT:
        if s["name"] != "backend":
            assert parsed[s["name"]] == other_value(s), s["name"]
    with pytest.raises(ValueError, match="evict=.*not true or false"):
        lmcache.parse_url("gdkv://?backend=memory&evict=maybe")


def test_a_connector_config_is_read_with_its_types():
    """One reader for every connector's config: JSON values and text (a URL's query) give the
    same settings; a value of the wrong type, or below a key's least value, names its key;
    None keeps the default; every connector key not given gets its default."""
    own = [gconfig.Key("threads", int, 4, "", 1), gconfig.Key("label", None, None, "")]
    text = {"nsid": "2", "retry_interval_s": "0.5", "evict": "false", "threads": "3",
            "label": 7, "namespace": None}
    typed = {"nsid": 2, "retry_interval_s": 0.5, "evict": False, "threads": 3, "label": 7}
    for given in (text, typed):
        read = gconfig.read_config(given, own, "a test config")
        assert {k: read[k] for k in typed} == typed
        # The connector's keys and a connection's get their defaults; the store's stay unset.
        assert read["namespace"] == "" and read["staging_bytes"] == 64 << 20
        assert read["timeout_ms"] == {s["name"]: s for s in CLIENT}["timeout_ms"]["default"]
        assert "capacity" not in read
    for key, bad, why in [("nsid", True, "not an integer"), ("nsid", 1.5, "not an integer"),
                          ("nsid", "one", "invalid literal"), ("evict", "maybe", "true or false"),
                          ("timeout_ms", [1], ""), ("threads", "0", "at least 1"),
                          ("timeout_ms", 0, r"must be in \[1, "),
                          ("retry_interval_s", "nan", "finite"),
                          ("retry_interval_s", float("inf"), "finite"),
                          ("namespace", ["a"], "not a string")]:
        with pytest.raises(ValueError, match=f"gdkv: {key}=.* in a test config: .*{why}"):
            gconfig.read_config({key: bad}, own, "a test config")


@pytest.mark.parametrize("s", CLIENT, ids=[s["name"] for s in CLIENT])
def test_gdkv_connect_takes_each_setting_and_refuses_bad_values(s):
    """gdkv.connect reads a connection's settings through the C++ table, as the connectors and
    the CLI do: the value held, a wrong type a TypeError, a value out of range a ValueError."""
    name = s["name"]
    v = other_value(s)
    assert gdkv._core.effective_settings({name: v}, "client")[name] == v
    with pytest.raises(TypeError, match=name):
        gdkv.connect("/nonexistent", **{name: "1" if s["type"] != "str" else 1})
    if s["type"] == "int":
        with pytest.raises(ValueError, match=rf"{name}: must be in \[{s['min']}, "):
            gdkv.connect("/nonexistent", **{name: s["max"] + 1})
    with pytest.raises(TypeError, match="unknown setting 'timeout'"):
        gdkv.connect("/nonexistent", timeout=1)


def test_one_default_for_a_connection_everywhere(gdkvd):
    """The connectors open a connection with the client table's defaults: EngineStore passes
    every one of them to gdkv.connect, and the connection opens."""
    by_name = {s["name"]: s for s in CLIENT}
    assert by_name["shared_memory_bytes"]["default"] == 1 << 30
    store = gdkv.engine.EngineStore({"socket_dir": gdkvd.dir})
    try:
        assert store.connect_options == {s["name"]: s["default"] for s in CLIENT}
        assert store.client() is not None
    finally:
        store.close()


def test_gdkvd_takes_every_flag_and_prints_every_key():
    daemon = gdkv.settings("daemon")
    args = [str(GDKVD), "--check-config"]
    for s in SETTINGS + daemon:
        v = other_value(s)
        if s["type"] == "bool":
            args.append(s["flag"] if v else "--no-" + s["flag"][2:])
        else:
            args += [s["flag"], oct(v).replace("0o", "0") if s["unit"] == "octal" else as_text(v)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    printed = tomllib.loads(out.stdout)
    for s in SETTINGS:
        table, key = s["toml"].split(".")
        assert printed[table][key] == other_value(s), s["toml"]
    for s in daemon:
        assert printed[s["toml"]] == other_value(s), s["toml"]


def test_the_docs_tables_are_the_settings_tables():
    """docs/settings.md's tables are generated from the rows (python -m gdkv.config FILE)."""
    path = ROOT / "docs" / "settings.md"
    text = path.read_text()
    assert text == gconfig.render(text), (
        f"docs/settings.md's tables differ from the settings: run python -m gdkv.config {path}")
    for key in gconfig.VLLM_KEYS + gconfig.LMCACHE_KEYS + gconfig.ENGINE_KEYS:
        assert f"| `{key.name}` |" in text, key.name
