"""Two real processes: handshake over the side channel, READ/WRITE verified byte for byte."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from transfer_peers import BLOCK_BYTES, BLOCKS, SpawnHolder, connect, pattern, wait_done

from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.inflight import InflightTracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def blocks_of(buffer: np.ndarray) -> np.ndarray:
    return buffer.reshape(BLOCKS, BLOCK_BYTES)


def scattered_permutation(seed: int) -> np.ndarray:
    """A permutation with no two consecutive entries adjacent, so NIXL cannot merge any pair."""
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(BLOCKS)
        if not np.any(np.diff(perm) == 1):
            return perm


def test_read_write_and_notifications(spawn_holder: SpawnHolder, decode_agent: NixlAgent) -> None:
    holder = spawn_holder("prefill-pair", seed=7)
    link = connect(decode_agent, holder)
    remote = blocks_of(pattern(7, BLOCKS * BLOCK_BYTES))
    local = blocks_of(link.local)

    # Random order on both sides: every descriptor travels on its own.
    local_ids, remote_ids = scattered_permutation(1), scattered_permutation(2)
    read = decode_agent.post("READ", link.local_handle, local_ids, link.remote_handle, remote_ids,
                             b"read-done")  # fmt: skip
    wait_done(decode_agent, read)
    assert np.array_equal(local[local_ids], remote[remote_ids])
    assert read.nbytes == BLOCKS * BLOCK_BYTES and read.desc_count == BLOCKS
    assert read.telemetry is not None and read.telemetry.desc_count == BLOCKS
    assert read.telemetry.total_bytes == BLOCKS * BLOCK_BYTES
    holder.expect(f"NOTIF {decode_agent.name} read-done")
    decode_agent.release(read)
    decode_agent.release(read)  # idempotent

    # Contiguous ids on both sides merge into one descriptor.
    link.local[:] = 0
    ids = np.arange(BLOCKS)
    contiguous = decode_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    wait_done(decode_agent, contiguous)
    assert np.array_equal(local, remote)
    assert contiguous.telemetry is not None and contiguous.telemetry.desc_count == 1

    # WRITE new bytes in scattered order; the attached notification asks the holder for a digest,
    # which it computes on arrival, so this also checks the data landed before the notification.
    link.local[:] = pattern(99, BLOCKS * BLOCK_BYTES)
    expected = remote.copy()
    expected[remote_ids] = local[local_ids]
    tracker = InflightTracker(decode_agent, stall_timeout_s=5.0)
    tracker.add(decode_agent.post("WRITE", link.local_handle, local_ids, link.remote_handle,
                                  remote_ids, b"digest"))  # fmt: skip
    end = time.monotonic() + 5.0
    result = tracker.poll_all(time.monotonic())
    while not result:
        assert time.monotonic() < end
        result = tracker.poll_all(time.monotonic())
    assert len(result.done) == 1 and not result.failed and result.done[0].released
    digest = holder.expect("DIGEST").split()[1]
    assert digest == hashlib.blake2b(expected.tobytes()).hexdigest()

    # A standalone notification.
    decode_agent.send_notif(link.remote_name, b"hello-42")
    holder.expect(f"NOTIF {decode_agent.name} hello-42")


def test_post_rejects_bad_index_arrays(spawn_holder: SpawnHolder, decode_agent: NixlAgent) -> None:
    link = connect(decode_agent, spawn_holder("prefill-bad-idx"))
    with pytest.raises(ValueError, match="equal"):
        decode_agent.post("READ", link.local_handle, [0, 1], link.remote_handle, [0])
    with pytest.raises(IndexError, match=r"\[0, 64\)"):
        decode_agent.post("READ", link.local_handle, [BLOCKS], link.remote_handle, [0])
    with pytest.raises(ValueError, match="local handle"):
        decode_agent.post("READ", link.remote_handle, [0], link.local_handle, [0])


def test_restarted_peer_with_same_name(spawn_holder: SpawnHolder, decode_agent: NixlAgent) -> None:
    first = spawn_holder("prefill-restart", seed=3)
    link = connect(decode_agent, first)
    ids = np.arange(BLOCKS)
    wait_done(
        decode_agent, decode_agent.post("READ", link.local_handle, ids, link.remote_handle, ids)
    )
    assert np.array_equal(link.local, pattern(3, BLOCKS * BLOCK_BYTES))
    first.stop()

    second = spawn_holder("prefill-restart", seed=4)
    decode_agent.release_dlist(link.local_handle)
    relinked = connect(decode_agent, second, local=link.local)  # new blob, same name: replaced
    assert relinked.remote_name == link.remote_name
    assert decode_agent.remote_names == {"prefill-restart"}
    read = decode_agent.post("READ", relinked.local_handle, ids, relinked.remote_handle, ids)
    wait_done(decode_agent, read)
    assert np.array_equal(link.local, pattern(4, BLOCKS * BLOCK_BYTES))
