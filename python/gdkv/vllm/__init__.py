"""vLLM stores and loads its KV cache through gdkv: ``GdkvConnector``, a KVConnectorBase_V1::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GdkvConnector",
        "kv_connector_module_path": "gdkv.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_dir": "/run/gdkvd"}}'

Contract: a block is reported as external tokens only when a lookup found every value it needs;
a value that does not arrive whole (a failed command, another length) fails only its blocks,
which vLLM then recomputes; a gdkvd that is down gives no external hits and drops saves, never
an error to vLLM. ``kv_producer`` saves and never loads, ``kv_consumer`` loads and never saves;
an engine without prefix caching only saves. The extra config (gdkv.engine's keys and
``blocks_per_value``, ``model_id``, ``save_queue_bytes``, ``load_mode``, ``layers_per_value``,
``removals_url``, ``heads_per_value``, ``kv_events_medium``, ``kv_events_locality``), the modes, KV
events and ``GDKV_VLLM_STATS``:
docs/integrations.md ("vLLM").

The package: ``plan`` (the KV cache groups and layout, values and keys, what travels to the
workers), ``scheduler`` (lookups, hints, the loads and saves planned, KV events), ``worker``
(registration, loads, staging, saves) and ``connector`` (vLLM's calls, each handed to one side).
Transfers go through :class:`gdkv.engine.EngineStore`, which the SGLang and LMCache connectors
share.
"""

from __future__ import annotations

from .connector import GdkvConnector
from .plan import GdkvMetadata, GdkvWorkerMeta, Transfer

__all__ = ["GdkvConnector", "GdkvMetadata", "GdkvWorkerMeta", "Transfer"]
