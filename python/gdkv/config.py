"""The connectors' config, declared once: every key a connector reads is a :class:`Key` row with
its type, default, least value or choices, and meaning.

- :data:`ENGINE_KEYS`: what every connector reads through :class:`gdkv.engine.EngineStore`
  (where gdkv is, the key space, the staging, reconnects), with the connection's rows (a
  client's settings, declared in C++: ``shared_memory_bytes``, ``timeout_ms``, ...). Its
  defaults are filled in by :func:`read_config`.
- :data:`STORE_KEYS`: the store's settings (declared in C++, ``gdkv.settings()``), for an
  in-process store (``backend``); passed to ``gdkv.open`` only when given, so their defaults
  stay gdkv.open's.
- Each connector's own keys: :data:`VLLM_KEYS`, :data:`LMCACHE_KEYS`; SGLang's own keys are
  passed through as they are (``gdkv.sglang.SGLANG_KEYS``).

:func:`read_config` reads a connector's config with these rows, and docs/settings.md's tables are
generated from them (:func:`markdown_tables`; ``python -m gdkv.config`` prints them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from . import _core

_TYPES = {"int": int, "bool": bool, "str": str, "list": list}


@dataclass(frozen=True)
class Key:
    """One key of a connector's config. ``type`` None: passed through as given (another
    program's key). ``least``/``most`` bound a number, ``choices`` a string (empty: any)."""

    name: str
    type: Optional[type]
    default: Any
    help: str
    least: Any = None
    most: Any = None
    choices: tuple[str, ...] = ()
    unit: str = ""

    def convert(self, value: Any) -> Any:
        """``value`` as this key's type (text, as in a URL's query, converted), checked against
        its bounds or choices; ValueError saying why not."""
        v = _CONVERT[self.type](value)
        if self.type is float and not math.isfinite(v):
            raise ValueError("must be a finite number")
        if self.least is not None and v < self.least:
            raise ValueError(f"must be at least {self.least}" if self.most is None
                             else f"must be in [{self.least}, {self.most}]")
        if self.most is not None and v > self.most:
            raise ValueError(f"must be in [{self.least}, {self.most}]")
        if self.choices and v not in self.choices:
            raise ValueError(f"{v!r} is not one of {', '.join(self.choices)}")
        return v


def _boolean(value: Any) -> bool:
    """A flag from JSON or YAML (a bool) or from text (a URL's query): true/false or 1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise ValueError("not true or false")
    return text in ("true", "1")


def _integer(value: Any) -> int:
    """An int from JSON (an int, or a float without a fraction) or from text; a bool is not."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("not an integer")
    return int(value)


def _string(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"not a string but {type(value).__name__}")
    return str(value)


_CONVERT: dict[Any, Callable[[Any], Any]] = {int: _integer, float: float, bool: _boolean,
                                             str: _string, None: lambda v: v}


def _key(s: dict[str, Any]) -> Key:
    """A row of the C++ tables (a dict of gdkv.settings()) as a key."""
    return Key(s["name"], _TYPES[s["type"]], s["default"], s["help"], s.get("min"), s.get("max"),
               tuple(s.get("choices") or ()), s["unit"])


def _rows(kind: str) -> list[Key]:
    """The C++ table's rows of ``kind`` as keys."""
    return [_key(s) for s in _core.settings() if s["kind"] == kind]


#: The store's settings (an in-process store), as gdkv.open takes them.
STORE_KEYS: list[Key] = _rows("store")
#: A connection's settings (gdkv.connect's): filled in with their defaults.
CLIENT_KEYS: list[Key] = _rows("client")
# A namespace's id, as gdkvd's namespace rows bound it.
_NSID: Key = next(k for k in _rows("namespace") if k.name == "nsid")
#: What every connector reads (EngineStore), the connection's settings included.
ENGINE_KEYS: list[Key] = [
    Key("socket_dir", str, "", "gdkvd's socket directory (empty: $GDKV_SOCKET_DIR)"),
    Key("backend", str, None, "an in-process store instead of gdkvd, with the store's settings "
        "as further keys (gdkv.open)", choices=tuple(_core.backends())),
    Key("nsid", int, _NSID.default, "NVMe namespace", _NSID.least, _NSID.most),
    Key("namespace", str, "", "a string mixed into every key: separate key spaces"),
    Key("staging_bytes", int, 64 << 20, "the engine-side staging values are copied through "
        "where gdkv does not reach the engine's memory in place, reserved at first use (through "
        "gdkvd at most half of shared_memory_bytes; at least one value)", 1, unit="bytes"),
    Key("retry_interval_s", float, 5.0, "after a failure, how long to wait before connecting "
        "again", 0, unit="s"),
    Key("cuda_device", int, None, "an in-process store's CUDA device (CUDA builds)", 0),
    *CLIENT_KEYS,
]
#: gdkv.open's own keywords besides the store's settings.
OPEN_KEYS = ("queue_depth", "cuda_device")

#: The vLLM connector's own keys (gdkv.vllm).
VLLM_KEYS: list[Key] = [
    Key("load_mode", str, "async", "when loaded KV reaches the engine: async (a request waits "
        "for its load over steps; the other requests run), sync (within the step that "
        "schedules it) or layerwise (the step's forward pass waits for each layer's chunk)",
        choices=("async", "sync", "layerwise")),
    Key("blocks_per_value", int, 1, "vLLM blocks per gdkv value", 1),
    Key("heads_per_value", int, 1, "KV heads per value (a divisor of a rank's heads): engines "
        "of any tensor-parallel size share values", 1),
    Key("layers_per_value", int, 0, "layers per value (0: every layer of a KV cache group)", 0),
    Key("model_id", str, "", "the model's name in the keys (empty: its path, config and weight "
        "files' fingerprint); set it alike on nodes that keep the model at different paths"),
    Key("save_queue_bytes", int, 1 << 30, "saves waiting for gdkv beyond this are dropped (the "
        "engine never waits for a save)", 0, unit="bytes"),
    Key("removals_url", str, "", "BlockRemoved KV events for values gdkvd removed are read over "
        "the connector's own gdkvd connection (its namespace only); an http://HOST:PORT/removed "
        "URL reads gdkvd's metrics port instead (every namespace)"),
    Key("kv_events_medium", str, "STORAGE", "the medium of the connector's KV events: STORAGE "
        "(gdkvd keeps values on a local store or RADOS) or CPU (a gdkvd that holds DRAM only: "
        "its memory backend)", choices=("STORAGE", "CPU")),
    Key("kv_events_locality", str, "LOCAL", "the locality of the connector's KV events: LOCAL "
        "(gdkvd on this node) or REMOTE (a gdkvd this engine reaches on another node)",
        choices=("LOCAL", "REMOTE")),
]
#: The LMCache connector's own keys (gdkv.lmcache).
LMCACHE_KEYS: list[Key] = [
    Key("threads", int, 4, "threads that run gdkv calls for LMCache's event loop", 1),
]


def keys_by_name(*tables: Iterable[Key]) -> dict[str, Key]:
    return {k.name: k for table in tables for k in table}


def defaults(keys: Iterable[Key]) -> dict[str, Any]:
    """Each key's default."""
    return {k.name: k.default for k in keys}


def read_config(config: Mapping[str, Any], own: Sequence[Key], where: str) -> dict[str, Any]:
    """``config`` with each value converted to its key's type and checked: EngineStore's keys
    (:data:`ENGINE_KEYS`), the store's settings (:data:`STORE_KEYS`) and the connector's ``own``.
    EngineStore's and the connector's keys that are not given (or given as None) get their
    defaults; the store's settings are left out unless given, so gdkv.open's defaults hold. A key
    none names, a value not of its type (text, as in a URL's query, is converted), below its least
    value or out of its choices is a ValueError naming it: a misspelt setting must not fall back
    to its default in silence, nor stop gdkv later."""
    engine = keys_by_name(ENGINE_KEYS, own)
    rows = {**keys_by_name(STORE_KEYS), **engine}
    unknown = sorted(set(config) - set(rows))
    if unknown:
        raise ValueError(f"gdkv: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} in {where} (known: "
                         f"{', '.join(sorted(rows))})")
    out = defaults(engine.values())
    for name, value in config.items():
        if value is None:   # None keeps the default, as in gdkv.open
            continue
        try:
            out[name] = rows[name].convert(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"gdkv: {name}={value!r} in {where}: {e}") from None
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def _accepted(k: Key) -> str:
    if k.choices:
        return ", ".join(k.choices)
    if k.least is not None and k.most is not None:
        return f"{k.least}..{k.most}"
    return f"at least {k.least}" if k.least is not None else ""


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (dicts) under ``columns`` (their keys)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _type(k: Key) -> str:
    name = k.type.__name__ if k.type else "any"
    return f"{name} ({k.unit})" if k.unit else name


def markdown_tables() -> dict[str, str]:
    """docs/settings.md's tables, by the name of the marker each sits behind: ``store``,
    ``daemon`` and ``client`` (the C++ tables), ``engine`` (every connector's) and one per
    connector's own keys."""
    tables = {}
    for kind in ("store", "daemon", "client", "namespace"):
        rows = []
        for s in _core.settings():
            if s["kind"] != kind:
                continue
            k = _key(s)
            default, accepted = _cell(k.default), _accepted(k)
            if s["unit"] == "octal":   # as TOML writes it
                default, accepted = f"`{oct(k.default)}`", f"{oct(k.least)}..{oct(k.most)}"
            rows.append({"setting": f"`{k.name}`", "gdkvd TOML": f"`{s['toml']}`" if s["toml"]
                         else "", "flag": f"`{s['flag']}`", "type": _type(k),
                         "default": default, "accepted": accepted, "meaning": k.help})
        columns = ["setting", "gdkvd TOML", "flag", "type", "default", "accepted", "meaning"]
        if kind == "client":
            columns.remove("gdkvd TOML")
        if kind == "namespace":   # keys of --namespace KEY=VALUE,..., no flags of their own
            columns.remove("flag")
        tables[kind] = markdown_table(rows, columns)
    own = {"engine": [k for k in ENGINE_KEYS if k not in CLIENT_KEYS], "vllm": VLLM_KEYS,
           "lmcache": LMCACHE_KEYS}
    for name, keys in own.items():
        tables[name] = markdown_table(
            [{"key": f"`{k.name}`", "type": _type(k), "default": _cell(k.default),
              "accepted": _accepted(k), "meaning": k.help} for k in keys],
            ["key", "type", "default", "accepted", "meaning"])
    return tables


def render(doc: str) -> str:
    """``doc`` (docs/settings.md) with each generated table replaced by the rows' own: a table
    sits between ``<!-- settings: NAME -->`` and ``<!-- end of settings: NAME -->``."""
    for name, table in markdown_tables().items():
        begin, end = f"<!-- settings: {name} -->\n", f"<!-- end of settings: {name} -->"
        if begin not in doc or end not in doc:
            raise ValueError(f"the settings doc has no {begin.strip()} ... {end} markers")
        doc = doc[:doc.index(begin) + len(begin)] + table + doc[doc.index(end):]
    return doc


if __name__ == "__main__":   # python -m gdkv.config DOC: rewrites DOC's tables in place
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.write_text(render(path.read_text()))
