"""kvlink as a vLLM KV connector. vLLM loads it with

    --kv-transfer-config '{"kv_connector": "KvlinkConnector",
                           "kv_connector_module_path": "kvlink.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

This package is the only place in kvlink that imports vLLM (see docs/vllm.md).
"""

from kvlink.integrations.vllm.connector import KvlinkConnector, KvlinkMetadata

__all__ = ["KvlinkConnector", "KvlinkMetadata"]
