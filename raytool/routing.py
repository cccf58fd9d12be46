"""The load-balancing policy of the LLM manager, as a plain object (the actor only holds it).

Picks a server per request: the trajectory's sticky server if it is healthy (its prefix cache holds
the conversation so far), else the server of the trajectory's group (GRPO siblings share a prompt
prefix) unless that one is busier than the least-loaded by more than `affinity_slack`, else the
server with the fewest requests in flight. Failed servers are ejected and their sessions re-routed.
"""

from __future__ import annotations

from collections import OrderedDict


class NoHealthyServer(RuntimeError):
    pass


class Router:
    def __init__(self, servers: list[str], affinity_slack: int = 4, max_sessions: int = 100_000):
        if not servers:
            raise ValueError("Router needs at least one server")
        self.in_flight: dict[str, int] = {s: 0 for s in servers}
        self.ejected: dict[str, str] = {}  # server -> why
        self.affinity_slack = affinity_slack
        self.max_sessions = max_sessions
        self._sticky: OrderedDict[str, str] = OrderedDict()  # session -> server (LRU-bounded)
        self._group: OrderedDict[str, str] = OrderedDict()  # group -> server

    @property
    def healthy(self) -> list[str]:
        return [s for s in self.in_flight if s not in self.ejected]

    def _remember(self, table: OrderedDict, key: str, server: str) -> None:
        table[key] = server
        table.move_to_end(key)
        while len(table) > self.max_sessions:
            table.popitem(last=False)

    def pick(self, session: str | None = None, group: str | None = None) -> str:
        """Choose a server for one request and count it as in flight."""
        healthy = self.healthy
        if not healthy:
            raise NoHealthyServer(f"all rollout servers are ejected: {self.ejected}")
        least = min(healthy, key=lambda s: self.in_flight[s])
        choice = None
        if session is not None and self._sticky.get(session) in healthy:
            choice = self._sticky[session]
        elif group is not None and self._group.get(group) in healthy:
            candidate = self._group[group]
            if self.in_flight[candidate] - self.in_flight[least] <= self.affinity_slack:
                choice = candidate
        if choice is None:
            choice = least
        if session is not None:
            self._remember(self._sticky, session, choice)
        if group is not None and self._group.get(group) not in healthy:  # new group, or its server died
            self._remember(self._group, group, choice)
        self.in_flight[choice] += 1
        return choice

    def done(self, server: str) -> None:
        """A request on `server` finished (successfully or not)."""
        if self.in_flight.get(server, 0) > 0:
            self.in_flight[server] -= 1

    def eject(self, server: str, reason: str) -> None:
        self.ejected[server] = reason

    def restore(self, server: str) -> None:
        self.ejected.pop(server, None)

    def end_session(self, session: str) -> None:
        self._sticky.pop(session, None)

    def stats(self) -> dict:
        return {"in_flight": dict(self.in_flight), "ejected": dict(self.ejected), "sessions": len(self._sticky)}
