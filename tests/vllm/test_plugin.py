"""The `vllm.general_plugins` entry point: installed kvlink declares it, it registers
`KvlinkConnector` with vLLM's connector factory by name (once, however often vLLM calls it),
and importing it loads no vLLM (no engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvlink.integrations.vllm import plugin

ENTRY_POINT = "kvlink.integrations.vllm.plugin:register"


def test_installed_kvlink_declares_the_entry_point() -> None:
    declared = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert declared.get("kvlink") == ENTRY_POINT, (
        f"vllm.general_plugins of the installed packages: {declared}; pyproject.toml declares "
        f"kvlink = {ENTRY_POINT!r}: reinstall kvlink (make) so its metadata has it")


def test_register_makes_the_name_resolve_and_may_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.START_ENV, raising=False)
    plugin.register()
    start = os.environ[plugin.START_ENV]  # this server's start, for its processes to inherit
    plugin.register()  # vLLM calls general plugins in every process, and a test may call it again
    assert os.environ[plugin.START_ENV] == start and len(start) == 32
    config = KVTransferConfig(kv_connector="KvlinkConnector", kv_role="kv_both")
    from kvlink.integrations.vllm.connector import KvlinkConnector

    assert KVConnectorFactory.get_connector_class(config) is KvlinkConnector


def test_the_module_path_form_resolves_to_the_same_class() -> None:
    config = KVTransferConfig(kv_connector="KvlinkConnector", kv_role="kv_both",
                              kv_connector_module_path="kvlink.integrations.vllm")
    from kvlink.integrations.vllm.connector import KvlinkConnector

    assert KVConnectorFactory.get_connector_class(config) is KvlinkConnector


def test_importing_the_entry_point_loads_no_vllm_nor_torch() -> None:
    code = ("import sys, kvlink.integrations.vllm.plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'nixl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
