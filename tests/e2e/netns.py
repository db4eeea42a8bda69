"""Hosts as Linux network namespaces for the multi-host tests: a bridge on this machine's side and one
namespace per host joined to it by a veth pair, on a private /24 (``10.231.<n>.0/24``, ``n`` drawn per
run so two runs never share a subnet). Everything is named after a run id and removed by ``close``
(processes left in the namespaces included), also when the test fails.

``partition(host)`` takes the host's link down (its packets go nowhere, as with a pulled cable or a dead
switch port) and ``heal`` brings it back; ``netem`` adds latency and loss where the kernel has ``sch_netem``.
``unavailable()`` says why namespaces cannot be made here (not root, no ``ip``), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"stprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    veth: str  # the host side of the pair, on the bridge
    peer: str  # the namespace's side
    address: str

    def wrap(self) -> tuple[str, ...]:
        """The command prefix that runs a program on this host."""
        return ("ip", "netns", "exec", self.netns)


class NetnsLab:
    """A bridge and namespaces; use as a context manager."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.subnet = random.randint(1, 254)
        self.bridge = f"stbr{self.id}"
        self.gateway = f"10.231.{self.subnet}.1"  # the bridge's address: the servers listen here
        self.hosts: dict[str, Host] = {}
        self._made_bridge = False

    def __enter__(self) -> NetnsLab:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        n = len(self.hosts) + 2
        peer = f"stp{self.id}{n}"
        host = Host(name, f"st{self.id}{name}", f"stv{self.id}{n}", peer, f"10.231.{self.subnet}.{n}")
        self.hosts[name] = host
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("link", "set", peer, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", peer)
        _ip("-n", host.netns, "link", "set", peer, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        return host

    def partition(self, host: Host) -> float:
        """Cut the host off; returns when (``time.time()``)."""
        _ip("link", "set", host.veth, "down")
        return time.time()

    def heal(self, host: Host) -> float:
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        return time.time()

    def netem(self, host: Host, *, delay_ms: int, loss_pct: float) -> str | None:
        """Delay and lose the host's packets (both ways); returns why not when the kernel cannot."""
        if shutil.which("tc") is None:
            return "no `tc` command"
        netem = ["root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        for where in (["dev", host.veth], ["-n", host.netns, "dev", host.peer]):  # both directions
            done = subprocess.run(
                ["tc", *where[:-2], "qdisc", "add", *where[-2:], *netem], capture_output=True, text=True
            )
            if done.returncode != 0:
                return f"`tc qdisc add ... netem` failed ({done.stderr.strip()}): this kernel has no sch_netem"
        return None

    def pids(self, host: Host) -> list[int]:
        got = _ip("netns", "pids", host.netns, check=False)
        return [int(p) for p in got.stdout.split()] if got.returncode == 0 else []

    def close(self) -> None:
        for host in self.hosts.values():
            for pid in self.pids(host):  # only processes inside this run's namespaces
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)  # gone with its peer's namespace, usually
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        self.hosts.clear()
