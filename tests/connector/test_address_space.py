"""The reader's and sealer's view of their own memory: ranges by address, one at a time or
many at once, and digests over them equal to one xxh3 stream over the same bytes."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import xxhash

from kvlink.connector.integrity import AddressSpace, digests


def _areas() -> tuple[list[np.ndarray], AddressSpace]:
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 10_000, 333)]
    return arrays, AddressSpace([(a.ctypes.data, a.nbytes) for a in arrays])


def test_many_ranges_at_once_are_the_same_bytes_as_one_by_one() -> None:
    arrays, space = _areas()
    addrs = np.array([arrays[1].ctypes.data + 7, arrays[0].ctypes.data, arrays[2].ctypes.data + 300], np.int64)
    lengths = np.array([9_993, 1, 33], np.int64)
    views = space.pieces(addrs, lengths)
    for view, addr, n in zip(views, addrs.tolist(), lengths.tolist(), strict=True):
        assert bytes(view) == bytes(space(addr, n))
    assert bytes(views[0]) == arrays[1][7:].tobytes()


@pytest.mark.parametrize(("area", "offset", "length"), [(0, 4000, 97), (2, 0, 334)])
def test_a_range_past_its_area_is_refused(area: int, offset: int, length: int) -> None:
    arrays, space = _areas()
    with pytest.raises(ValueError, match="runs past its area"):
        space.pieces(np.array([arrays[area].ctypes.data + offset], np.int64), np.array([length], np.int64))


def test_a_range_below_every_area_is_refused() -> None:
    arrays, space = _areas()
    lowest = min(a.ctypes.data for a in arrays)
    with pytest.raises(ValueError, match="below every registered area"):
        space.pieces(np.array([lowest - 64], np.int64), np.array([8], np.int64))


def test_a_units_digest_is_one_stream_over_its_pieces_in_order() -> None:
    arrays, space = _areas()
    base0, base1 = arrays[0].ctypes.data, arrays[1].ctypes.data
    addrs = np.array([base0, base1 + 100, base1, base0 + 50], np.int64)
    lengths = np.array([40, 0, 256, 10], np.int64)  # an empty range adds nothing
    got = digests(space, addrs, lengths, np.array([0, 3, 4], np.int64), [11, 2**64 - 1])
    want0 = xxhash.xxh3_64(arrays[0][:40].tobytes() + arrays[1][:256].tobytes(), seed=11).intdigest()
    want1 = xxhash.xxh3_64(arrays[0][50:60].tobytes(), seed=2**64 - 1).intdigest()
    assert got == [want0, want1]


def test_lookups_on_another_thread_see_whole_areas_while_areas_are_added() -> None:
    """D adds a staging area on its own thread while the verifier's planning thread looks up
    another load's bytes: every lookup returns the bytes asked for, never a torn index."""
    arrays, space = _areas()
    addrs = np.array([a.ctypes.data + 1 for a in arrays], np.int64)
    lengths = np.array([a.nbytes - 1 for a in arrays], np.int64)
    want = [a[1:].tobytes() for a in arrays]
    added: list[np.ndarray] = []  # kept alive: the space holds views of them
    errors: list[BaseException] = []
    stop = threading.Event()

    def look() -> None:
        try:
            while not stop.is_set():
                assert [bytes(v) for v in space.pieces(addrs, lengths)] == want
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    reader = threading.Thread(target=look)
    reader.start()
    try:
        for i in range(300):
            area = np.full(64 + i, i % 251, dtype=np.uint8)
            added.append(area)
            space.add(area.ctypes.data, area)
    finally:
        stop.set()
        reader.join(timeout=30)
        sys.setswitchinterval(interval)
    assert not reader.is_alive() and not errors, errors[:1]
    for area in added:
        assert bytes(space(area.ctypes.data, area.nbytes)) == area.tobytes()
