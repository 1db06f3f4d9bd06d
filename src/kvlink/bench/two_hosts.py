"""Two "hosts" on one machine: P and D in two network namespaces joined by a veth pair.

The P-D link carries only the KV path (UCX over TCP: `UCX_TLS=tcp`, `UCX_NET_DEVICES`
set to each side's end of it). The root namespace (the test or bench, the router, a
colocated reference) reaches each namespace over one more veth pair. P serves HTTP on its
P-D link address (the `remote_host` D reads from), which the root namespace reaches
through P's root-facing veth by a host route; D serves on its root-facing address. Every
name carries a per-run tag and every address is a private /30 of the `10.<octet>.0.0/22`
given, inside namespaces created here and deleted on exit. Needs root and iproute2;
`limit_link` adds a `tc` rate limit on both ends of the P-D link.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TwoHosts:
    ns_p: str
    ns_d: str
    link_p: str  # P's end of the P-D link (in ns_p)
    link_d: str  # D's end of the P-D link (in ns_d)
    p_addr: str  # P's address on the P-D link: where P serves and is reached
    d_addr: str  # D's address on the P-D link
    d_http_addr: str  # D's address on its root-facing veth: where D serves


def ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=10)


def netns_unavailable(tag: str) -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvprobe{tag}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` failed: {error.stderr.decode(errors='replace').strip()}"
    return None


@contextlib.contextmanager
def two_hosts(tag: str, octet: int) -> Iterator[TwoHosts]:
    """Build the namespaces and links named after `tag` in 10.`octet`.0.0/22; delete them on exit."""
    net = f"10.{octet}"
    hosts = TwoHosts(ns_p=f"kvp{tag}", ns_d=f"kvd{tag}", link_p=f"kvkp{tag}", link_d=f"kvkd{tag}",
                     p_addr=f"{net}.0.1", d_addr=f"{net}.0.2", d_http_addr=f"{net}.2.2")
    hp_root, hp_ns = f"kvhp{tag}", f"kvhq{tag}"  # root <-> P
    hd_root, hd_ns = f"kvhd{tag}", f"kvhe{tag}"  # root <-> D
    ns_p, ns_d = hosts.ns_p, hosts.ns_d
    try:
        for ns in (ns_p, ns_d):
            ip("netns", "add", ns)
            ip("link", "set", "lo", "up", netns=ns)
        ip("link", "add", hosts.link_p, "type", "veth", "peer", "name", hosts.link_d)
        ip("link", "add", hp_root, "type", "veth", "peer", "name", hp_ns)
        ip("link", "add", hd_root, "type", "veth", "peer", "name", hd_ns)
        for dev, ns in ((hosts.link_p, ns_p), (hp_ns, ns_p), (hosts.link_d, ns_d), (hd_ns, ns_d)):
            ip("link", "set", dev, "netns", ns)
        ip("addr", "add", f"{hosts.p_addr}/30", "dev", hosts.link_p, netns=ns_p)
        ip("addr", "add", f"{hosts.d_addr}/30", "dev", hosts.link_d, netns=ns_d)
        ip("addr", "add", f"{net}.1.2/30", "dev", hp_ns, netns=ns_p)
        ip("addr", "add", f"{hosts.d_http_addr}/30", "dev", hd_ns, netns=ns_d)
        ip("addr", "add", f"{net}.1.1/30", "dev", hp_root)
        ip("addr", "add", f"{net}.2.1/30", "dev", hd_root)
        for dev, ns in ((hosts.link_p, ns_p), (hp_ns, ns_p), (hosts.link_d, ns_d), (hd_ns, ns_d)):
            ip("link", "set", dev, "up", netns=ns)
        for dev in (hp_root, hd_root):
            ip("link", "set", dev, "up")
        # P owns p_addr, so the root namespace's host route to it forwards nothing.
        ip("route", "add", f"{hosts.p_addr}/32", "via", f"{net}.1.2")
        yield hosts
    finally:
        for dev in (hp_root, hd_root):
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=10)
        for ns in (ns_p, ns_d):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def link_bytes(hosts: TwoHosts) -> int:
    """Bytes D's end of the P-D link has received so far."""
    out = subprocess.run(["ip", "netns", "exec", hosts.ns_d, "cat",
                          f"/sys/class/net/{hosts.link_d}/statistics/rx_bytes"],
                         capture_output=True, text=True, timeout=5, check=True).stdout
    return int(out)


def limit_link(hosts: TwoHosts, rate: str | None) -> None:
    """Rate-limit both directions of the P-D link (`tc` token bucket, e.g. "1gbit"), or lift
    the limit (None)."""
    for netns, dev in ((hosts.ns_p, hosts.link_p), (hosts.ns_d, hosts.link_d)):
        base = ["ip", "netns", "exec", netns, "tc", "qdisc"]
        subprocess.run([*base, "del", "dev", dev, "root"], capture_output=True, timeout=10)
        if rate is not None:
            # burst: a few ms of the rate, at least 64 KiB; queued packets wait up to 100 ms
            subprocess.run([*base, "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                            "latency", "100ms"], check=True, capture_output=True, timeout=10)
