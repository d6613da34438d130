"""A model folder's weights fingerprint (:func:`weights_fingerprint`), which connectors put in the
model they name in the key salt, so two checkpoints at one path never share KV. Environment:
``GDKV_CACHE_DIR`` (default ``~/.cache/gdkv``) holds its cache, ``weights-fingerprints.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading

log = logging.getLogger("gdkv.engine")

#: What a model folder's weights are stored in.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files up to this size are hashed whole; larger ones are sampled (_file_digest).
FULL_HASH_BYTES = 64 << 20
_EDGE_BYTES = 1 << 20          # a sampled file: its first and last MiB,
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10   # and 64 evenly spaced 64 KiB pieces
_CACHE_FILE = "weights-fingerprints.json"
_CACHE_LOCK = threading.Lock()


def cache_dir() -> str:
    """Where gdkv keeps small per-user caches: $GDKV_CACHE_DIR, else ~/.cache/gdkv."""
    return os.environ.get("GDKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "gdkv")


def _file_digest(path: str, size: int) -> str:
    """The digest of one weight file's content: all of it up to FULL_HASH_BYTES; above, a
    safetensors header in full (it names every tensor, its dtype, shape and offsets), the first
    and last MiB and 64 evenly spaced 64 KiB samples."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return h.hexdigest()
        fd = f.fileno()
        if path.endswith(".safetensors"):
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            h.update(os.pread(fd, min(n, size - 8, 256 << 20), 8))
        h.update(os.pread(fd, _EDGE_BYTES, 0))
        h.update(os.pread(fd, _EDGE_BYTES, size - _EDGE_BYTES))
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for i in range(_SAMPLES):
            h.update(os.pread(fd, _SAMPLE_BYTES, i * step))
    return h.hexdigest()


def _load_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: str, entries: dict) -> None:
    """Merges ``entries`` into the cache file and replaces it atomically (a temporary file
    renamed over it: a reader sees the old file or the new one, never half of one). A cache
    that cannot be written is only slower next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _CACHE_LOCK:
            data = _load_cache(path)   # another process may have added files meanwhile
            data.update(entries)
            fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError as e:
        log.debug("gdkv: cannot write %s (%s)", path, e)


def weights_fingerprint(model: str) -> str:
    """A digest naming the weights of the model at ``model``: a local folder (its weight files:
    *.safetensors, *.bin, *.pt, *.pth, *.gguf, not recursing) or one weight file (a .gguf). ""
    when ``model`` is not local (a hub name) or holds no weight file.

    Each file's name, size and content (:func:`_file_digest`: whole up to 64 MiB, sampled above)
    go in. A file's digest is cached in $GDKV_CACHE_DIR/weights-fingerprints.json under its real
    path, keyed by its size, mtime, ctime and inode: a re-touched file is read again (and gives
    the same digest if its content did not change), an unchanged one is not read at all.
    """
    if os.path.isdir(model):
        names = sorted(n for n in os.listdir(model) if n.endswith(WEIGHT_SUFFIXES))
        files = [os.path.join(model, n) for n in names]
    elif os.path.isfile(model):
        names, files = [os.path.basename(model)], [model]
    else:
        return ""
    files_and_names = [(f, n) for f, n in zip(files, names) if os.path.isfile(f)]
    if not files_and_names:
        return ""
    cache_path = os.path.join(cache_dir(), _CACHE_FILE)
    cache = _load_cache(cache_path)
    fresh: dict[str, dict] = {}
    h = hashlib.blake2b(digest_size=16)
    try:
        for f, name in files_and_names:
            real = os.path.realpath(f)
            st = os.stat(real)
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            entry = cache.get(real)
            if isinstance(entry, dict) and entry.get("stat") == stamp:
                digest = entry["digest"]
            else:
                digest = _file_digest(real, st.st_size)
                fresh[real] = {"stat": stamp, "digest": digest}
            h.update(json.dumps([name, st.st_size, digest]).encode())
    except OSError as e:   # unreadable: the weights go unnamed (the path and config still are)
        log.warning("gdkv: cannot fingerprint the weights in %s (%s); set model_id to name "
                    "them", model, e)
        return ""
    if fresh:
        _save_cache(cache_path, fresh)
    return h.hexdigest()
