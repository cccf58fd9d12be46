"""Simulated nodes on one machine: network namespaces joined to a bridge, one shaped link each.

`Nodes(n, mbit)` makes a namespace holding a bridge (the switch) and `n` node namespaces, each
with one veth link to the bridge whose two ends are shaped by `tc` to `mbit` (token bucket): a
node's one NIC, full duplex. Node i has the address 10.213.<net>.(i+1) on that link; no address
is added outside the namespaces it created, and `close()` (or leaving the `with`) deletes them
all. A process joins a node with `enter(name)` before it opens any socket. Needs root
(CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

from raytool.errors import RaytoolError

CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise RaytoolError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _in(ns: str, *cmd: str) -> None:
    _ip("netns", "exec", ns, *cmd)


def enter(ns: str) -> None:
    """Move this process (its network stack) into namespace `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def available() -> str | None:
    """None when this process can build the namespaces; else why not, in one line."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"simulated nodes need iproute2 ({', '.join(missing)} not found)"
    return None


class Nodes:
    def __init__(self, n: int, mbit: float):
        why = available()
        if why:
            raise RaytoolError(why)
        tag = f"{os.getpid() % 100000}"
        self.net = os.getpid() % 250 + 1
        self.switch = f"rtsw{tag}"
        self.names = [f"rtn{tag}-{i}" for i in range(n)]
        self.addresses = [f"10.213.{self.net}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            self._build(mbit)
        except BaseException:
            self.close()
            raise

    def _build(self, mbit: float) -> None:
        shape = ["tbf", "rate", f"{mbit}mbit", "burst", f"{max(32, int(mbit * 1000 / 8 / 100))}kb", "latency", "50ms"]
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.switch, "ip", "link", "set", "br0", "up")
        _in(self.switch, "ip", "link", "set", "lo", "up")
        for i, (ns, address) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            # both ends are created inside the switch's namespace, then one end moves to the node
            _in(self.switch, "ip", "link", "add", f"p{i}", "type", "veth", "peer", "name", f"n{i}")
            _in(self.switch, "ip", "link", "set", f"n{i}", "netns", ns)
            _in(self.switch, "ip", "link", "set", f"p{i}", "master", "br0")
            _in(self.switch, "ip", "link", "set", f"p{i}", "up")
            _in(self.switch, "tc", "qdisc", "add", "dev", f"p{i}", "root", *shape)  # toward the node
            _in(ns, "ip", "link", "set", "lo", "up")
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", f"n{i}")
            _in(ns, "ip", "link", "set", f"n{i}", "up")
            _in(ns, "tc", "qdisc", "add", "dev", f"n{i}", "root", *shape)  # from the node

    def close(self) -> None:
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
