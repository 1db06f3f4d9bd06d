"""vLLM's `vllm.general_plugins` entry point: registers `KvlinkConnector` by name, so a
`--kv-transfer-config` of `{"kv_connector": "KvlinkConnector", ...}` needs no module path.

Imports nothing of vLLM until vLLM calls `register`, and then only its connector factory:
the connector class (torch, NIXL) loads when vLLM first asks the factory for it.
"""

from __future__ import annotations

import os
import uuid

CONNECTOR_NAME = "KvlinkConnector"
# One start of a vLLM server: set by the first of its processes that loads the plugin (the
# API server) and inherited by the engine core and the workers it spawns. The connector
# names its incarnation after it, so a P restarted under a fixed engine_id is told apart.
START_ENV = "KVLINK_VLLM_START"
CONNECTOR_MODULE = "kvlink.integrations.vllm.connector"

_registered = False


def register() -> None:
    """Register the connector's name with vLLM's connector factory, once per process.

    vLLM runs its general plugins in each of its processes (API server, engine core,
    workers), and a forked child inherits its parent's registry; the factory refuses a
    name registered twice, so a second call here does nothing.
    """
    global _registered
    if not os.environ.get(START_ENV):
        os.environ[START_ENV] = uuid.uuid4().hex
    if _registered:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    _registered = True
