"""The load-balancing policy of the LLM manager, as a plain object (the actor only holds it and does the RPCs).

Picks a server per request, in this order:

1. the trajectory's sticky server (its prefix cache holds the conversation so far), if healthy and
   not excluded for this request;
2. else the server of the trajectory's GRPO group (siblings share the prompt prefix), unless it has
   more than `affinity_slack` requests in flight above the least-loaded server: then the least loaded
   takes the request and becomes the group's home, so that a burst of siblings splits over two
   servers instead of scattering its prompt over all of them. The default slack of 8 keeps a group
   of 8 whole when a GRPO step arrives at once (`raytool bench router`: slack 4 without re-homing
   got 83% prefix hits and a 6% longer makespan, against 90% now);
3. else the server with the fewest requests in flight (ties: fewest requests ever assigned, then the
   order the servers were given).

A pin (session -> server, group -> server) made before a server's ejection is void: sessions and
groups on an ejected server move on their next pick and do not come back when it is readmitted.
Both tables are LRU-bounded by `max_sessions`. A pick costs one pass over the servers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

log = logging.getLogger(__name__)


class NoHealthyServer(RuntimeError):
    pass


@dataclass
class _Counters:
    requests: int = 0  # picks that chose this server
    ok: int = 0
    failed: int = 0
    ejections: int = 0
    epoch: int = 0  # bumped on each ejection; a pin remembers the epoch it was made in
    latency_sum_s: float = 0.0
    latency_n: int = 0


class Router:
    def __init__(self, servers: list[str], affinity_slack: int = 8, max_sessions: int = 100_000):
        if not servers:
            raise ValueError("Router needs at least one server")
        if len(set(servers)) != len(servers):
            raise ValueError(f"Router servers must have distinct names, got {servers}")
        self.in_flight: dict[str, int] = {s: 0 for s in servers}
        self.ejected: dict[str, str] = {}  # server -> why
        self.affinity_slack = affinity_slack
        self.max_sessions = max_sessions
        self._counters: dict[str, _Counters] = {s: _Counters() for s in servers}
        self._sessions: OrderedDict[str, tuple[str, int]] = OrderedDict()  # session -> (server, epoch)
        self._groups: OrderedDict[str, tuple[str, int]] = OrderedDict()  # group -> (server, epoch)

    @property
    def healthy(self) -> list[str]:
        return [s for s in self.in_flight if s not in self.ejected]

    def pick(self, session: str | None = None, group: str | None = None, exclude: Collection[str] = ()) -> str:
        """Choose a server for one request (never one in `exclude`) and count it as in flight."""
        least, least_key = None, None
        for name, n in self.in_flight.items():
            if name in self.ejected or name in exclude:
                continue
            key = (n, self._counters[name].requests)
            if least_key is None or key < least_key:
                least, least_key = name, key
        if least is None:
            raise NoHealthyServer(self._nothing_left(exclude))
        choice = None
        pin = self._sessions.get(session) if session is not None else None
        if pin is not None and self._alive(pin) and pin[0] not in exclude:
            choice = pin[0]
        elif group is not None:
            home = self._groups.get(group)
            if home is None or not self._alive(home):  # a new group, or its server was ejected: re-home
                home = (least, self._counters[least].epoch)
            if home[0] not in exclude:  # (a retry elsewhere leaves the group where its prompt is cached)
                if self.in_flight[home[0]] - least_key[0] <= self.affinity_slack:
                    choice = home[0]
                else:  # overflow: the siblings still to come follow this one instead of scattering
                    home = (least, self._counters[least].epoch)
            self._remember(self._groups, group, home)
        if choice is None:
            choice = least
        if session is not None:
            self._remember(self._sessions, session, (choice, self._counters[choice].epoch))
        self.in_flight[choice] += 1
        self._counters[choice].requests += 1
        return choice

    def done(self, server: str, *, ok: bool = True, latency_s: float | None = None) -> None:
        """A request picked onto `server` finished (ok or failed); call exactly once per pick."""
        if server not in self.in_flight:
            raise KeyError(f"Router.done: unknown server {server!r} (known: {sorted(self.in_flight)})")
        if self.in_flight[server] == 0:
            log.warning("Router.done(%r) with nothing in flight there (done called twice?); not counted", server)
            return
        self.in_flight[server] -= 1
        c = self._counters[server]
        if ok:
            c.ok += 1
        else:
            c.failed += 1
        if latency_s is not None:
            c.latency_sum_s += latency_s
            c.latency_n += 1

    def eject(self, server: str, reason: str) -> None:
        """Take `server` out of rotation; its sessions and groups re-home on their next pick. An
        already ejected server keeps its first reason: later failures (its other requests failing
        while it restarts) are consequences, not the cause."""
        if server not in self.in_flight:
            raise KeyError(f"Router.eject: unknown server {server!r} (known: {sorted(self.in_flight)})")
        if server not in self.ejected:
            self._counters[server].ejections += 1
            self._counters[server].epoch += 1
            self.ejected[server] = reason

    def readmit(self, server: str) -> None:
        """Put an ejected server back into rotation, with no sticky sessions or groups."""
        if server not in self.in_flight:
            raise KeyError(f"Router.readmit: unknown server {server!r} (known: {sorted(self.in_flight)})")
        self.ejected.pop(server, None)

    restore = readmit

    def end_session(self, session: str) -> None:
        self._sessions.pop(session, None)

    def stats(self) -> dict:
        servers = {
            name: {
                "in_flight": self.in_flight[name],
                "requests": c.requests,
                "ok": c.ok,
                "failed": c.failed,
                "ejected": self.ejected.get(name),
                "ejections": c.ejections,
                "mean_latency_s": c.latency_sum_s / c.latency_n if c.latency_n else None,
            }
            for name, c in self._counters.items()
        }
        return {
            "servers": servers,
            "sessions": len(self._sessions),
            "groups": len(self._groups),
            "in_flight": dict(self.in_flight),
            "ejected": dict(self.ejected),
        }

    def _alive(self, pin: tuple[str, int]) -> bool:
        server, epoch = pin
        return server not in self.ejected and self._counters[server].epoch == epoch

    def _remember(self, table: OrderedDict, key: str, pin: tuple[str, int]) -> None:
        table[key] = pin
        table.move_to_end(key)
        while len(table) > self.max_sessions:
            table.popitem(last=False)

    def _nothing_left(self, exclude: Collection[str]) -> str:
        ejected = ", ".join(f"{s} ({why})" for s, why in self.ejected.items()) or "none"
        excluded = ", ".join(s for s in self.in_flight if s in exclude and s not in self.ejected) or "none"
        return f"no rollout server left to pick: ejected: {ejected}; excluded for this request: {excluded}"
