"""Single-process agent behaviour: config checks, progress-thread delay, registration, metadata."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvlink.transfer import nixl_import
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.agent_config import AgentConfig
from kvlink.transfer.descs import peek_agent_name

pytestmark = pytest.mark.timeout(30)


def test_config_rejects_a_spinning_progress_thread() -> None:
    with pytest.raises(ValueError, match="spin"):
        AgentConfig(progress_thread=True, progress_delay_us=0)
    with pytest.raises(ValueError, match="num_threads"):
        AgentConfig(num_threads=-1)


def test_progress_thread_with_delay_stays_idle() -> None:
    """The stock thread polls with a zero timeout (a full core); ours must sleep between polls."""
    real_bindings = nixl_import.api.nixlBind
    with NixlAgent("idle-check", AgentConfig(progress_thread=True, progress_delay_us=1000)):
        assert nixl_import.api.nixlBind is real_bindings
        time.sleep(0.1)
        cpu_before, wall_before = time.process_time(), time.monotonic()
        time.sleep(0.5)
        cpu_used = time.process_time() - cpu_before
        wall = time.monotonic() - wall_before
    assert cpu_used < 0.3 * wall, f"idle agent used {cpu_used:.3f} s CPU in {wall:.3f} s"


def test_register_once_and_metadata_names_the_agent() -> None:
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    other = np.zeros(1 << 12, dtype=np.uint8)
    with NixlAgent("local-reg") as agent:
        regions = [(buffer.ctypes.data, buffer.nbytes), (other.ctypes.data, other.nbytes)]
        assert agent.register_regions(regions) == 2
        assert agent.register_regions(np.array(regions[:1], dtype=np.uint64)) == 0
        assert peek_agent_name(agent.metadata()) == "local-reg"
        with pytest.raises(KeyError, match="not loaded"):
            agent.prep_remote("nobody", np.array([[buffer.ctypes.data, 16, 0]]))
        handle = agent.prep_local(np.array([[buffer.ctypes.data, 4096, 0]], dtype=np.uint64))
        agent.release_dlist(handle)
        agent.release_dlist(handle)
        with pytest.raises(ValueError, match="Nx2"):
            agent.register_regions([(1, 2, 3)])  # type: ignore[list-item]
    assert peek_agent_name(b"not metadata") is None
