"""D: params are good for one request. P frees its blocks once a decoder has read them and
may hand them to another request while the params still look valid (signed, in their
lease); a second request arriving with the same params would read that other request's KV.

`UsedParams` remembers the params this engine took, until their lease ends (past it they
are refused as expired anyway), so a replay is refused like expired params. Bounded:
past `capacity` live entries the ones whose lease ends first are forgotten.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from kvlink.connector.params import RemotePrefillParams, StaleTransferParams

DEFAULT_CAPACITY = 200_000


class UsedParams:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: dict[Hashable, str] = {}
        self._expiry: list[tuple[int, int, Hashable]] = []  # heap of (expires_at_ms, order, key)
        self._order = 0

    def __len__(self) -> int:
        return len(self._owner)

    @staticmethod
    def key(params: RemotePrefillParams) -> Hashable:
        return (params.remote_engine_id, params.remote_incarnation, params.remote_request_id,
                params.kv_signature, params.kv_expires_at_ms)

    def claim(self, params: RemotePrefillParams, request_id: str, now_s: float) -> None:
        """Record that `request_id` uses `params`; raise `StaleTransferParams` when a request
        took them before (another, or one that finished under the same id: engines enter a
        request once). Params with no expiry are not tracked."""
        if params.kv_expires_at_ms is None:
            return
        self._forget(now_s * 1000)
        key = self.key(params)
        owner = self._owner.get(key)
        if owner is not None:
            raise StaleTransferParams(
                f"kv_transfer_params of P's request {params.remote_request_id!r} were already used by "
                f"request {owner!r} on this instance: P frees its blocks once they are read and may "
                "have given them to another request; params are good for one request, send the "
                "request through the prefill instance again")
        self._owner[key] = request_id
        self._order += 1
        heapq.heappush(self._expiry, (params.kv_expires_at_ms, self._order, key))
        while len(self._owner) > self.capacity:
            _, _, oldest = heapq.heappop(self._expiry)
            self._owner.pop(oldest, None)

    def _forget(self, now_ms: float) -> None:
        while self._expiry and self._expiry[0][0] < now_ms:
            _, _, key = heapq.heappop(self._expiry)
            self._owner.pop(key, None)
