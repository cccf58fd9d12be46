"""Telling a dead receiver from a slow one while a weight sync waits on it.

A receiver binds its sockets before its address is handed out, and its kernel accepts TCP
connections however busy the process is: a connection that is refused or dropped and stays down
means the process is gone. Each PUSH socket to a receiver is watched by a ZMQ monitor; a peer whose
connection has been down for `DOWN_AFTER_S` is reported at once, instead of after the sync's whole
timeout (minutes, sized for a slow load). A connection that comes back in time (a reconnect) is
not.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

DOWN_AFTER_S = 5.0
_UP = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_DELAYED


class WatchedPeers:
    """One PUSH socket per peer address, each with a monitor that tracks whether its connection is up."""

    def __init__(self, ctx: zmq.Context, send_timeout_s: float, down_after_s: float = DOWN_AFTER_S):
        self.ctx, self.send_timeout_s, self.down_after_s = ctx, send_timeout_s, down_after_s
        self.sockets: dict[str, zmq.Socket] = {}
        self._monitors: dict[str, zmq.Socket] = {}
        self._down_since: dict[str, float | None] = {}

    def socket(self, address: str) -> zmq.Socket:
        if address not in self.sockets:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, so a dead peer times out
            self._monitors[address] = sock.get_monitor_socket(_UP | _DOWN)
            self._down_since[address] = time.monotonic()  # until it connects
            sock.connect(address)
            self.sockets[address] = sock
        return self.sockets[address]

    def down_for(self, address: str) -> float:
        """Seconds the connection to `address` has been down (0.0: it is up), its monitor's events read first."""
        monitor = self._monitors.get(address)
        if monitor is None:
            return 0.0
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event & _UP:
                self._down_since[address] = None
            elif event & _DOWN and self._down_since[address] is None:
                self._down_since[address] = time.monotonic()
        since = self._down_since[address]
        return 0.0 if since is None else time.monotonic() - since

    def dead(self, addresses) -> list[str]:
        """Those of `addresses` (peers of ours) whose connection has been down for down_after_s."""
        return [a for a in addresses if a in self.sockets and self.down_for(a) >= self.down_after_s]

    def close(self) -> None:
        for address, sock in self.sockets.items():
            sock.disable_monitor()
            self._monitors[address].close(linger=0)
            sock.close(linger=0)
        self.sockets.clear()
        self._monitors.clear()
        self._down_since.clear()
