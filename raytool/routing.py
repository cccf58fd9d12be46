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
3. else the least loaded server: its requests in flight from this router, plus those from other
   routers that the server itself reported on its last answer, if that answer is under
   `load_ttl_s` old (`observe`; each agent-loop worker routes for itself, see raytool.dataplane).
   Ties: fewest requests ever assigned, then the order the servers were given. A fleet larger
   than `scan` servers is not scanned whole: the least loaded of `scan` servers drawn at random
   (the "power of d choices": with d >= 2 the most loaded server stays within a few requests of
   the mean), so a pick costs about the same at 1,024 servers as at 8 (`raytool bench scale`).

A pin (session -> server, group -> server) made before a server's ejection is void: sessions and
groups on an ejected server move on their next pick and do not come back when it is readmitted.
Both tables are LRU-bounded by `max_sessions`.
"""

from __future__ import annotations

import logging
import random
import time
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
    def __init__(self, servers: list[str], affinity_slack: int = 8, max_sessions: int = 100_000, load_ttl_s: float = 2.0,
                 scan: int = 8, seed: int = 0):
        if not servers:
            raise ValueError("Router needs at least one server")
        if len(set(servers)) != len(servers):
            raise ValueError(f"Router servers must have distinct names, got {servers}")
        self.in_flight: dict[str, int] = {s: 0 for s in servers}
        self.ejected: dict[str, str] = {}  # server -> why
        self.affinity_slack = affinity_slack
        self.load_ttl_s = load_ttl_s
        self.scan = scan
        self._names = list(servers)
        self._random = random.Random(seed)
        self._others: dict[str, tuple[int, float]] = {}  # server -> (its requests from other routers, when it said so)
        self.max_sessions = max_sessions
        self._counters: dict[str, _Counters] = {s: _Counters() for s in servers}
        self._sessions: OrderedDict[str, tuple[str, int]] = OrderedDict()  # session -> (server, epoch)
        self._groups: OrderedDict[str, tuple[str, int]] = OrderedDict()  # group -> (server, epoch)

    @property
    def healthy(self) -> list[str]:
        return [s for s in self.in_flight if s not in self.ejected]

    def pick(self, session: str | None = None, group: str | None = None, exclude: Collection[str] = ()) -> str:
        """Choose a server for one request (never one in `exclude`) and count it as in flight."""
        now = time.monotonic() if self._others else 0.0
        least, least_key = None, None
        if len(self._names) > self.scan:  # a large fleet: the least loaded of a random few
            least, least_key = self._least(self._random.sample(self._names, self.scan), exclude, now)
        if least is None:  # a small fleet, or every drawn server was out
            least, least_key = self._least(self._names, exclude, now)
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
                if self.in_flight[home[0]] + self._others_on(home[0], now) - least_key[0] <= self.affinity_slack:
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

    def _least(self, names, exclude: Collection[str], now: float) -> tuple[str | None, tuple | None]:
        least, least_key = None, None
        for name in names:
            if name in self.ejected or name in exclude:
                continue
            key = (self.in_flight[name] + self._others_on(name, now), self._counters[name].requests)
            if least_key is None or key < least_key:
                least, least_key = name, key
        return least, least_key

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

    def observe(self, server: str, server_in_flight: int) -> None:
        """`server` answered one of this router's requests and said how many requests it holds
        now (from every router, this answer's own request already gone)."""
        mine = self.in_flight.get(server, 0) - 1  # this answer's request is still counted here until done()
        self._others[server] = (max(0, server_in_flight - max(0, mine)), time.monotonic())

    def _others_on(self, server: str, now: float) -> int:
        seen = self._others.get(server)
        return seen[0] if seen is not None and now - seen[1] < self.load_ttl_s else 0

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
