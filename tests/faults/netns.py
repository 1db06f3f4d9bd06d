"""Two hosts for tests: `kvlink.bench.two_hosts`, plus what only tests need (fail or skip
when namespaces cannot be made, unread socket bytes)."""

from __future__ import annotations

import os
import subprocess

import pytest

from kvlink.bench.two_hosts import TwoHosts, ip, link_bytes, netns_unavailable, two_hosts

__all__ = ["TwoHosts", "ip", "link_bytes", "netns_unavailable", "require_netns", "two_hosts", "unread_in_netns"]


def require_netns(tag: str, *, skip_outside_ci: bool) -> None:
    """Fail with the reason when namespaces cannot be made; outside CI (env CI != true), skip
    instead where `skip_outside_ci` (a non-root developer)."""
    why = netns_unavailable(tag)
    if why is None:
        return
    if skip_outside_ci and os.environ.get("CI", "").lower() != "true":
        pytest.skip(f"{why} (run as root with iproute2; in CI, env CI=true, this fails instead)")
    pytest.fail(f"two network namespaces are needed, but {why}; run this test as root with "
                "iproute2 installed")


def unread_in_netns(netns: str, port: int) -> int:
    """Bytes received but not yet read on established TCP sockets of `port` inside `netns`."""
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-tnH", "state", "established",
                          f"( sport = :{port} )"], capture_output=True, text=True, timeout=5,
                         check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())
