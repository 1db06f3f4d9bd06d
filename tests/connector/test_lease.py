"""Lease table: frees on the last consumer, on expiry, extends on heartbeats."""

from __future__ import annotations

from kvlink.connector.lease import LeaseTable


def table() -> LeaseTable:
    return LeaseTable(duration_s=30.0, extension_s=20.0)


def test_frees_when_every_consumer_notified() -> None:
    t = table()
    t.hold("r", now=0.0)
    t.notify("r", expected=2, now=1.0)
    assert t.collect(1.0) == (set(), set())
    t.notify("r", expected=2, now=2.0)
    assert t.collect(2.0) == ({"r"}, set())
    assert not t.leases


def test_expires_and_counts() -> None:
    t = table()
    t.hold("r", now=0.0)
    assert t.collect(29.9) == (set(), set())
    assert t.collect(30.0) == (set(), {"r"})
    assert t.expired_total == 1


def test_heartbeat_extends_but_never_shortens() -> None:
    t = table()
    t.hold("r", now=0.0)
    t.heartbeat(["r", "unknown"], now=25.0)
    assert t.leases["r"].deadline == 45.0
    t.heartbeat(["r"], now=1.0)
    assert t.leases["r"].deadline == 45.0
    assert t.collect(44.0) == (set(), set())
    assert t.collect(45.0) == (set(), {"r"})


def test_notification_before_hold_is_applied() -> None:
    t = table()
    t.notify("r", expected=1, now=0.0)
    assert t.unknown_notifs_total == 1
    t.hold("r", now=0.5)
    assert t.collect(0.5) == ({"r"}, set())


def test_early_notifications_are_forgotten_after_ttl() -> None:
    t = table()
    t.notify("r", expected=1, now=0.0)
    t.collect(100.0)
    t.hold("r", now=100.0)
    assert t.collect(100.0) == (set(), set())


def test_release_drops_lease() -> None:
    t = table()
    t.hold("r", now=0.0)
    assert t.release("r")
    assert not t.release("r")
    assert t.collect(100.0) == (set(), set())
