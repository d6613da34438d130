"""vLLM stores and loads its KV cache through gdkv: ``GdkvConnector``, a KVConnectorBase_V1.

Turn it on with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GdkvConnector",
        "kv_connector_module_path": "gdkv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket_dir": "/run/gdkvd"}}'

``kv_role``: ``kv_both`` saves and loads; ``kv_producer`` (a prefill engine of a disaggregated
deployment) saves and never loads, and its steps wait for their saves, so a request's first
token comes back once its KV is in gdkv; ``kv_consumer`` (a decode engine) loads and never saves.
An engine whose prefix caching is off (vLLM turns it off where its attention cannot compute past
cached tokens, as for MLA on CPU) saves and never loads.

Through gdkvd (``socket_dir``) only, in a vLLM server: its scheduler and worker are separate
processes, so an in-process ``backend`` would be two stores (the connector warns). Environment:
``GDKV_VLLM_STATS=PATH``: each worker writes its counters (values and bytes loaded, the load
time, saves) to ``PATH.rank<N>.json`` when the engine stops.

Extra config: gdkv.engine's keys (``socket_dir`` or ``backend``, ``nsid``, ``namespace``,
``timeout_ms``, ``shared_memory_bytes``, ``staging_bytes``, ``retry_interval_s``...) and

    blocks_per_value   vLLM blocks stored under one gdkv key (default 1): fewer, larger values
    model_id           names the model's weights in the keys (default: the model path and
                       revision, a digest of its HF config and gdkv.engine.weights_fingerprint
                       of its weight files); set it to name the weights yourself
    save_queue_bytes   saves waiting for gdkv beyond this are dropped (default 1 GiB; through
                       gdkvd at most what shared_memory_bytes leaves past the load staging,
                       staging_bytes, reserved at the first load through CUDA or unshared pages)
    load_mode          "async" (default): a request waits in WAITING_FOR_REMOTE_KVS while its
                       values load and the engine's steps go on; "sync": the request is
                       scheduled in the step that plans its load, which finishes before that
                       step's forward pass (docs/serving.md measures both); "layerwise": as
                       sync, but each layer's attention waits only for its own values
                       (wait_for_layer_load) and saves start layer by layer (save_kv_layer)
    layers_per_value   layers in one gdkv value (default 0: all of a group's): with fewer,
                       a layerwise step runs the first layers while later ones load; engines
                       share values only of the same layers_per_value
    removals_url       gdkvd's /removed (http://HOST:PORT/removed): KV events also report the
                       announced values gdkvd then removed
    heads_per_value    KV heads in one gdkv value (default 1): engines of any tensor-parallel
                       size share values of the same heads_per_value; it must divide the heads
                       a rank holds (layouts that keep a head's tokens apart, LBNHC, use a
                       rank's heads)

How it works, and what each mode and failure does: docs/integrations.md ("vLLM"). The package:
``plan`` (the KV cache groups and layout, values and keys, what travels to the workers),
``scheduler`` (lookups, hints, the loads and saves planned, KV events), ``worker``
(registration, loads, staging, saves) and ``connector`` (vLLM's calls, each handed to one side).
Lookups, loads, puts and deletes go through :class:`gdkv.engine.EngineStore`'s transfer calls,
which the SGLang and LMCache connectors share: a key whose command fails fails only its value,
which vLLM then recomputes; a gdkvd that is down gives no external hits and drops saves.
"""

from __future__ import annotations

from .connector import GdkvConnector
from .plan import GdkvMetadata, GdkvWorkerMeta, Transfer

__all__ = ["GdkvConnector", "GdkvMetadata", "GdkvWorkerMeta", "Transfer"]
