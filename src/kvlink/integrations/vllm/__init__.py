"""kvlink as a vLLM KV connector. vLLM loads it with

    --kv-transfer-config '{"kv_connector": "KvlinkConnector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

finding the name through installed kvlink's `vllm.general_plugins` entry point (`.plugin`),
or with `"kv_connector_module_path": "kvlink.integrations.vllm"` added, through this package.
This package is the only place in kvlink that imports vLLM (see docs/vllm.md). The connector
classes are loaded on first access (PEP 562), so `kvlink.integrations.vllm.models`, `.launch`
and `.plugin` (model dirs, server command lines, the entry point) import without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlink.integrations.vllm.connector import KvlinkConnector, KvlinkMetadata

__all__ = ["KvlinkConnector", "KvlinkMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvlink.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
