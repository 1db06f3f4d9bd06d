"""P-side lease table: finished requests whose blocks wait for D to read them.

A lease ends when every expected consumer has notified, or when it expires.
Heartbeats from D extend it. Notifications may overtake the lease's registration
(D can read before P's worker hears about the finish), so early ones are parked
for a short while and applied when the lease arrives. Pure: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EARLY_NOTIF_TTL_S = 60.0
MAX_EARLY_NOTIFS = 10_000


@dataclass
class Lease:
    request_id: str
    deadline: float
    expected: int | None = None
    notified: int = 0


@dataclass
class LeaseTable:
    duration_s: float
    extension_s: float
    leases: dict[str, Lease] = field(default_factory=dict)
    _early: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    expired_total: int = 0
    unknown_notifs_total: int = 0

    def hold(self, request_id: str, now: float) -> None:
        """Start holding a finished request's blocks."""
        lease = Lease(request_id, now + self.duration_s)
        self.leases[request_id] = lease
        early = self._early.pop(request_id, None)
        if early is not None:
            _, count, expected = early
            lease.notified = count
            lease.expected = expected

    def notify(self, request_id: str, expected: int, now: float) -> None:
        """One consumer finished reading (or gave up); `expected` consumers in total."""
        if expected <= 0:
            raise ValueError(f"expected consumers must be positive, got {expected}")
        lease = self.leases.get(request_id)
        if lease is None:
            self._park(request_id, expected, now)
            return
        lease.expected = expected
        lease.notified += 1

    def _park(self, request_id: str, expected: int, now: float) -> None:
        self.unknown_notifs_total += 1
        if len(self._early) >= MAX_EARLY_NOTIFS:
            oldest = min(self._early, key=lambda k: self._early[k][0])
            del self._early[oldest]
        _, count, _ = self._early.get(request_id, (now, 0, expected))
        self._early[request_id] = (now, count + 1, expected)

    def heartbeat(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            lease = self.leases.get(rid)
            if lease is not None:
                lease.deadline = max(lease.deadline, now + self.extension_s)

    def release(self, request_id: str) -> bool:
        """Drop a lease without waiting (P-side abort). True if one was held."""
        return self.leases.pop(request_id, None) is not None

    def collect(self, now: float) -> tuple[set[str], set[str]]:
        """Remove and return (fully notified, expired) request ids."""
        done = {
            r for r, lease in self.leases.items()
            if lease.expected is not None and lease.notified >= lease.expected
        }
        expired = {r for r, lease in self.leases.items() if r not in done and lease.deadline <= now}
        for rid in done | expired:
            del self.leases[rid]
        self.expired_total += len(expired)
        stale = [r for r, (t, _, _) in self._early.items() if now - t > EARLY_NOTIF_TTL_S]
        for rid in stale:
            del self._early[rid]
        return done, expired
