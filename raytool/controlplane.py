"""The control plane of the rollout servers: the one owner of who serves, on which weights, and of
each weight sync's plan. Generate calls do not go through it: each agent-loop worker and gateway
routes its own (raytool.dataplane).

It owns, and nobody else holds a copy they act on:
- **the policy version** the servers should hold, set by each weight sync's plan (`plan_sync`): the
  driver and the rollout stream ask it; which servers are behind it (`stale`: restarted, or failed a sync);
- **membership**: which servers serve and why the others do not, as numbered `Membership`
  snapshots the data planes long-poll (`membership`) and get back from their reports;
- **health**: a data plane that saw a server fail reports it (`report`); the control plane confirms
  it before every plane drops the server: an error the server raised is its own word; a server said
  to have died or be unreachable is ejected when it does not answer a health probe within
  `stall_timeout_s` or answers on an older policy version (Ray restarted it); a stalled one when its
  own progress report agrees, and it is then restarted (a fresh engine, handled like a kill). A
  server that answers well stays in, and the reporting plane takes it back. It alone decides a
  server's death: a sync that a server did not ack is its verdict too (`synced`).
- **re-admission**: ejected servers are probed in the background (`ready()` then a one-token
  generate, each under a timeout). One on the current policy version is re-admitted; one on an
  older version is handed to the next weight sync (`plan_sync`) and re-admitted by `synced` once
  its weights are current;
- **weight syncs**: each sync's version, its passes' attempt numbers (a receiver drops an earlier
  pass's leftovers by them) and its targets: every healthy server plus the ones waiting for current weights.

Its holder (actors.llm_manager) may be restarted with its process. The version and the sync
attempts are then read back from where `record` put them (`Record`); the rest is rebuilt from the
servers on the first call that needs it (`rebuild`): their weight receivers' addresses from
`ready()`, servers behind the version go to the next sync, servers that do not answer are ejected.
Data planes keep serving on their last membership meanwhile, and take the new one's snapshots (a
new `incarnation`) when it is back.

Plain Python, tested without Ray; the calls to the servers are the `Servers` transport's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Protocol

import msgspec

from raytool.dataplane import FailureKind, Membership, ServerFailed
from raytool.errors import one_line
from raytool.types import ServerHealth, ServerProgress

log = logging.getLogger(__name__)


class Servers(Protocol):
    """The control plane's calls to the rollout servers. Each raises ServerFailed when the server
    failed, died or cannot be reached; the control plane bounds each by its own timeout."""

    async def ready(self, server: str) -> list[str]:
        """The addresses its weight receivers listen on (its engine has started)."""

    async def health(self, server: str) -> ServerHealth: ...

    async def progress(self, server: str) -> ServerProgress: ...

    async def probe(self, server: str) -> None:
        """A one-token generate: the engine serves."""

    def restart(self, server: str) -> None:
        """Kill the server's process so that it starts again with a fresh engine."""


class Record(msgspec.Struct, frozen=True):
    """What the control plane cannot learn back from the servers after its holder restarted (a server
    Ray restarted with it holds the base weights): kept by its holder where a restart finds it."""

    policy_version: int = 0
    sync_attempts: int = 0


class SyncPlan(msgspec.Struct, frozen=True):
    """One weight-sync pass: the version it carries, its attempt number, and server -> receiver addresses."""

    version: int
    attempt: int
    targets: dict[str, list[str]]


class SyncAck(msgspec.Struct, frozen=True):
    """A server's word that a sync's weights are in its live engine."""

    server: str
    tensors: int
    version: int
    seconds: float
    attestation: int = 0  # the combined digest of the sync as the server verified it against what it loaded


class SyncResult(msgspec.Struct, frozen=True):
    """What one weight sync did: its version, what the trainer sent (bytes, buckets, seconds), the
    servers' acks, and server -> why for the servers that did not take it (ejected)."""

    version: int
    sent: dict[str, float]
    acks: list[SyncAck]
    failed: dict[str, str]


class ControlStats(msgspec.Struct, frozen=True):
    servers: list[str]
    healthy: list[str]
    ejected: dict[str, str]  # server -> why, with its latest probe's answer
    policy_version: int
    stale: list[str]  # alive, behind on weights: the next sync's
    retries: int  # calls the data planes retried elsewhere (one per report)
    membership: str  # incarnation/epoch


class Events(Protocol):
    """Where the control plane's events are counted (actors.metrics.ManagerMetrics)."""

    def retried(self, server: str) -> None: ...

    def ejected(self, server: str) -> None: ...


class ControlPlane:
    def __init__(self, servers: list[str], transport: Servers, *, stall_timeout_s: float = 60.0, probe_interval_s: float = 5.0,
                 probe_timeout_s: float = 60.0, record: Record | None = None, keep: Callable[[Record], None] | None = None,
                 on_change: Callable[[Membership], None] | None = None, events: Events | None = None):
        """`record`: what a restarted holder kept (None: a fresh start, nothing to rebuild); `keep`
        stores each new Record where a restart finds it; `on_change` gets every new membership."""
        self.names = list(servers)
        self.transport = transport
        self.stall_timeout_s = stall_timeout_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.ejected: dict[str, str] = {}  # server -> why it is out of rotation
        self.probe_failures: dict[str, str] = {}  # ejected server -> what its latest probe got
        self.stale: dict[str, list[str]] = {}  # alive again but behind on weights -> its receiver addresses
        self.addresses: dict[str, list[str]] = {}  # server -> weight receiver addresses
        self.policy_version = record.policy_version if record else 0
        self.sync_attempts = record.sync_attempts if record else 0
        self.retries = 0
        self.incarnation = uuid.uuid4().hex[:8]
        self.epoch = 0
        self.rebuilt = record is None
        self._keep = keep
        self._on_change = on_change
        self.events = events  # where ejections and retries are counted (None: nowhere)
        self._changed = asyncio.Event()  # set (and replaced) on every membership change
        self.attested: dict[str, int] = {}  # server -> the last version whose weights it attested (`synced`)
        self._confirming: dict[str, asyncio.Task] = {}  # server -> the check of a report on it
        self._probe_task: asyncio.Task | None = None

    # -- membership -------------------------------------------------------------------------------

    def snapshot(self) -> Membership:
        return Membership(self.incarnation, self.epoch, list(self.names), self._reasons())

    def _reasons(self) -> dict[str, str]:
        """Why each ejected server is out: its ejection's cause, with its latest probe's answer."""
        return {name: cause + (f" (last probe failed: {self.probe_failures[name]})" if name in self.probe_failures else "")
                for name, cause in self.ejected.items()}

    def _changed_now(self) -> None:
        self.epoch += 1
        if self._on_change is not None:
            self._on_change(self.snapshot())
        self._changed.set()
        self._changed = asyncio.Event()

    async def membership(self, incarnation: str = "", epoch: int = -1, timeout_s: float = 30.0) -> Membership:
        """The current snapshot: at once when the caller's (incarnation, epoch) is not it, else on
        the next change or after timeout_s (a long poll)."""
        await self.rebuild()
        if incarnation == self.incarnation and epoch == self.epoch:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.snapshot()

    def set_addresses(self, addresses: dict[str, list[str]]) -> None:
        """Where servers' weight receivers listen (from the graph's start, or a sync that found them moved)."""
        unknown = set(addresses) - set(self.names)
        if unknown:
            raise ValueError(f"addresses of unknown rollout servers {sorted(unknown)} (known: {self.names})")
        self.addresses.update({name: list(a) for name, a in addresses.items()})
        self.rebuilt = True

    def stats(self) -> ControlStats:
        return ControlStats(list(self.names), self.healthy(), self._reasons(), self.policy_version,
                            sorted(self.stale), self.retries, f"{self.incarnation}/{self.epoch}")

    def healthy(self) -> list[str]:
        return [n for n in self.names if n not in self.ejected]

    async def rebuild(self) -> None:
        """After its holder restarted: the servers' addresses, and which of them are behind the
        recorded policy version (or, when one holds a newer one, that one's)."""
        if self.rebuilt:
            return
        self.rebuilt = True

        async def ask(name: str) -> tuple[list[str], int]:
            addresses = await asyncio.wait_for(self.transport.ready(name), self.probe_timeout_s)
            return addresses, (await asyncio.wait_for(self.transport.health(name), self.probe_timeout_s)).policy_version

        answers = await asyncio.gather(*(ask(name) for name in self.names), return_exceptions=True)
        versions = {name: a[1] for name, a in zip(self.names, answers) if not isinstance(a, BaseException)}
        self.policy_version = max(self.policy_version, *versions.values()) if versions else self.policy_version
        for name, answer in zip(self.names, answers):
            if isinstance(answer, BaseException):
                self._eject(name, f"no answer after the manager restarted: {_cause(answer)}")
                continue
            self.addresses[name] = list(answer[0])
            if versions[name] != self.policy_version:
                self._eject(name, f"on policy version {versions[name]}, behind {self.policy_version}", probe=False)
                self.stale[name] = list(answer[0])
        self._changed_now()
        self._record()
        log.warning("llm manager restarted: state rebuilt from %d servers (policy version %d, %d behind, %d not answering)",
                    len(versions), self.policy_version, len(self.stale), len(self.names) - len(versions))

    def _record(self) -> None:
        if self._keep is not None:
            self._keep(Record(self.policy_version, self.sync_attempts))

    # -- health -----------------------------------------------------------------------------------

    async def report(self, server: str, kind: FailureKind, cause: str, role: str = "") -> Membership:
        """A data plane saw `server` fail a call (and retried it elsewhere): confirm, decide, and
        answer with the membership decided."""
        await self.rebuild()
        if server not in self.names:
            raise ValueError(f"report on unknown rollout server {server!r} (known: {sorted(self.names)})")
        self.retries += 1
        if self.events is not None:
            self.events.retried(server)
        if server not in self.ejected:
            if server not in self._confirming:
                self._confirming[server] = asyncio.get_running_loop().create_task(self._confirm(server, kind, cause, role))
            task = self._confirming[server]
            try:
                await asyncio.shield(task)
            finally:
                if task.done():
                    self._confirming.pop(server, None)
        return self.snapshot()

    async def _confirm(self, server: str, kind: FailureKind, cause: str, role: str) -> None:
        why = f"{kind}: {cause}" + (f" (seen by {role})" if role else "")
        if kind == "raised":  # the server's own answer
            self._eject(server, why)
            return
        try:
            if kind == "stalled":
                progress = await asyncio.wait_for(self.transport.progress(server), self.stall_timeout_s)
                confirmed = progress.idle_s > self.stall_timeout_s
            else:
                health = await asyncio.wait_for(self.transport.health(server), self.stall_timeout_s)
                confirmed = health.policy_version != self.policy_version
                if confirmed:
                    why += f"; back on policy version {health.policy_version}, behind {self.policy_version}"
        except (asyncio.TimeoutError, ServerFailed) as exc:
            confirmed = True
            why += f"; confirmed: {_cause(exc, self.stall_timeout_s)}"
        if not confirmed:
            log.info("rollout server %s reported %s, but it answers on the current policy version: kept in rotation", server, why)
            return
        self._eject(server, why)
        if kind == "stalled":
            # A stalled engine does not come back by itself: its process is restarted with a fresh
            # engine, which the next sync re-loads (handled like a kill).
            self.transport.restart(server)

    def _eject(self, name: str, reason: str, probe: bool = True) -> None:
        """Out of every plane's rotation. An already ejected server keeps its first reason: later
        failures (its other requests failing while it restarts) are consequences, not the cause."""
        if name not in self.ejected:
            log.warning("ejecting rollout server %s: %s", name, reason)
            if self.events is not None:
                self.events.ejected(name)
            self.ejected[name] = reason
            self._changed_now()
        if probe:
            self._ensure_probing()

    def _readmit(self, name: str) -> None:
        self.probe_failures.pop(name, None)
        if self.ejected.pop(name, None) is not None:
            self._changed_now()

    def _ensure_probing(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while self.ejected:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self._probe(name) for name in list(self.ejected) if name not in self.stale))

    async def _probe(self, name: str) -> None:
        """Re-admit an ejected server that answers on the current weights; hand one on other weights
        (a restarted engine's base weights, or a load that failed half-way) to the next weight sync."""
        try:
            addresses = await asyncio.wait_for(self.transport.ready(name), self.probe_timeout_s)
            health = await asyncio.wait_for(self.transport.health(name), self.probe_timeout_s)
            if health.policy_version == self.policy_version:
                await asyncio.wait_for(self.transport.probe(name), self.probe_timeout_s)
        except asyncio.TimeoutError:
            return  # still restarting or still hung: try again later
        except ServerFailed as exc:  # keep why it was ejected, with the latest probe's answer
            self.probe_failures[name] = exc.cause
            return
        self.addresses[name] = list(addresses)
        if health.policy_version == self.policy_version:
            log.info("re-admitting rollout server %s (policy version %d)", name, self.policy_version)
            self._readmit(name)
        else:
            log.info("rollout server %s is back on policy version %d; re-admitted after the next weight sync", name, health.policy_version)
            self.stale[name] = list(addresses)

    # -- weight syncs -----------------------------------------------------------------------------

    async def plan_sync(self, version: int | None = None, only: list[str] | None = None) -> SyncPlan:
        """The next weight-sync pass: `version` (None: the next one, policy_version + 1), a new
        attempt number, and its targets: every healthy server plus the recovered ones waiting for
        current weights (only those in `only`, when given). A pass at the current version (after a
        broken chain, or to the servers that wait for it) takes the same call."""
        await self.rebuild()
        version = self.policy_version + 1 if version is None else version
        self.sync_attempts += 1
        self._record()
        targets = {name: self.addresses.get(name, []) for name in self.names if name not in self.ejected}
        targets.update(self.stale)
        if only is not None:
            targets = {name: a for name, a in targets.items() if name in only}
        return SyncPlan(version, self.sync_attempts, targets)

    async def plan_resync(self) -> SyncPlan | None:
        """A pass of the current weights to the servers that serve again once they hold them (Ray
        restarted them, or they failed a sync and came back), or None when none waits."""
        await self.rebuild()
        return await self.plan_sync(self.policy_version, sorted(self.stale)) if self.stale else None

    def synced(self, version: int, acked: list[str], failed: dict[str, str], hung: list[str] = (),
               sent: int | None = None, attestations: dict[str, int] | None = None) -> dict[str, str]:
        """After a weight sync: the new policy version (versions only go up: a late word on an older
        sync changes none); re-admit recovered servers that took it, eject servers that did not, and
        restart those of them that hung in the load (`hung`: alive, never acked), as a stalled one.

        `sent`: the trainer's attestation of the sync (its pieces' digests, combined); `attestations`:
        each acking server's, of what it loaded. A server's version is attested only when the two
        agree; one whose does not is ejected like a server that failed the sync (the next sync
        re-loads it), so it serves nothing more of that version. Returns server -> why, for every
        server that did not take the sync (those `failed` named and those not attested)."""
        failed = dict(failed)
        if sent is not None:
            for name in list(acked):
                theirs = (attestations or {}).get(name, 0)
                if theirs != sent:
                    failed[name] = (f"its weights are not attested: it reports digest {theirs:016x} of what it loaded, "
                                    f"the trainer sent {sent:016x}")
                else:
                    self.attested[name] = version
            acked = [name for name in acked if name not in failed]
        if version > self.policy_version:
            self.policy_version = version
            self._record()
        for name in acked:
            if self.stale.pop(name, None) is not None:
                log.info("re-admitting rollout server %s after its weight re-sync (v%d)", name, version)
                self._readmit(name)
        for name, reason in failed.items():
            self.stale.pop(name, None)
            self.attested.pop(name, None)
            self._eject(name, f"weight sync v{version} failed: {reason}", probe=False)
        for name in hung:
            self.transport.restart(name)
        if failed:
            self._ensure_probing()
        return failed


def _cause(exc: BaseException, timeout_s: float | None = None) -> str:
    """A failed call to a server, in words: the server's failure, or the time it did not answer in."""
    if isinstance(exc, ServerFailed):
        return exc.cause
    if isinstance(exc, asyncio.TimeoutError) and timeout_s is not None:
        return f"no answer within {timeout_s:g}s"
    return one_line(exc)
