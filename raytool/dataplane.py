"""The data plane: a process that makes generate calls routes them itself, straight to the rollout
servers, and learns from the control plane which servers serve.

One `DataPlane` lives in every agent-loop worker and gateway (`actors.dataplane` gives it its
transport and keeps its membership current). Per call it picks a server with the `Router` policy
(sticky sessions, group affinity, least loaded), waits for the answer, and on a failure takes that
server out of its own rotation, reports it to the control plane (which confirms before every other
worker drops it, and answers with the membership it decided), and retries on another server:

- a server that died, raised, or is unreachable (`ServerFailed`, typed by the transport);
- a server that stalled: no answer within `stall_timeout_s`, and its own progress report says its
  engine produced no token for longer than that while requests wait (a long turn on a working
  server is never cut), or the progress probe itself goes unanswered (a hung process);
- an invalid request (`InvalidRequest`: the engine refused the request itself) goes back to the
  caller instead: every server would refuse it;
- a caller that gives up (its task is cancelled) cancels the call on its server too.

Membership arrives as versioned `Membership` snapshots: `apply` refuses a malformed one whole and
ignores an older one; a server this plane reported and has not heard back about stays out of its
rotation until the control plane's answer arrives.

Load: each answer carries its server's count of requests in flight (from every caller), which the
router adds to its own count for that server for a short while (`Router.observe`).

Plain Python, tested without Ray; the RPCs are the transport's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

import msgspec

from raytool.routing import NoHealthyServer, Router
from raytool.types import PromptScores, SamplingParams, ServerProgress, TokenOutput

log = logging.getLogger(__name__)

FailureKind = Literal["died", "raised", "stalled", "unreachable"]


class ServerFailed(Exception):
    """A call failed because of its server (not because of the request)."""

    def __init__(self, server: str, kind: FailureKind, cause: str):
        super().__init__(f"rollout server {server} {kind}: {cause}")
        self.server, self.kind, self.cause = server, kind, cause


class InvalidRequest(ValueError):
    """The engine refused the request itself (a prompt longer than max_model_len, ...)."""


class Membership(msgspec.Struct, frozen=True):
    """The control plane's word on who serves: a snapshot, numbered per control-plane process. It
    changes only when a server leaves or comes back: the policy version is not in it (the control
    plane owns it; each answer names the version it was sampled with), so a weight sync that every
    server took sends no plane anything."""

    incarnation: str  # the control plane process that made it (a restarted one starts a new count)
    epoch: int  # bumped on every change
    servers: list[str]
    ejected: dict[str, str]  # server -> why

    def problem(self, known: list[str]) -> str | None:
        """Why this snapshot cannot be applied by a plane that routes to `known`, or None."""
        if not self.incarnation or self.epoch < 0:
            return f"bad header (incarnation={self.incarnation!r}, epoch={self.epoch})"
        if sorted(self.servers) != sorted(known):
            return f"servers {sorted(self.servers)} are not this plane's {sorted(known)}"
        if not set(self.ejected) <= set(known):
            return f"ejects unknown servers {sorted(set(self.ejected) - set(known))}"
        return None


class Transport(Protocol):
    async def generate(self, server: str, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        """The server's answer; raises ServerFailed or InvalidRequest; cancelling it cancels the call on the server."""

    async def score(self, server: str, ids: list[int], request_id: str) -> PromptScores:
        """The server's log-probs of `ids` (a teacher's); raises ServerFailed or InvalidRequest, like generate."""

    async def progress(self, server: str) -> ServerProgress:
        """How long its engine has gone without a token while requests wait; raises ServerFailed."""


Report = Callable[[str, FailureKind, str], Awaitable[Membership | None]]


class DataPlane:
    def __init__(self, servers: list[str], transport: Transport, report: Report, *, affinity_slack: int = 8,
                 stall_timeout_s: float = 60.0, no_server_wait_s: float = 600.0, wait_poll_s: float = 1.0, role: str = "data plane"):
        self.router = Router(servers, affinity_slack=affinity_slack)
        self.transport = transport
        self.report = report
        self.stall_timeout_s = stall_timeout_s
        self.no_server_wait_s = no_server_wait_s
        self.wait_poll_s = wait_poll_s
        self.role = role  # who holds it, for its log lines
        self.membership: Membership | None = None
        self.reporting: dict[str, asyncio.Task] = {}  # server -> the report on it still waiting for the control plane
        self.calls = 0
        self.retries = 0

    # -- membership -------------------------------------------------------------------------------

    def apply(self, update: Membership) -> bool:
        """Take the control plane's snapshot -> True when applied; a malformed one is refused and
        logged (nothing of it applied), an older one of the same incarnation ignored."""
        if not isinstance(update, Membership):
            log.error("%s: refused a membership update that is a %s, not a Membership", self.role, type(update).__name__)
            return False
        problem = update.problem(list(self.router.in_flight))
        if problem:
            log.error("%s: refused membership update %s/%d: %s", self.role, update.incarnation, update.epoch, problem)
            return False
        current = self.membership
        if current is not None and current.incarnation == update.incarnation and update.epoch <= current.epoch:
            return False
        for name in self.router.in_flight:
            if name in update.ejected:
                self.router.eject(name, update.ejected[name])
            elif name not in self.reporting:
                self.router.readmit(name)
        self.membership = update
        return True

    # -- routing ----------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                       session: str | None = None, group: str | None = None) -> TokenOutput:
        """Route one request; on a server failure drop that server and retry on another. With no
        healthy server left (the only one is restarting, say) wait up to no_server_wait_s for the
        control plane to re-admit one, then raise NoHealthyServer."""
        return await self._route(lambda name: self.transport.generate(name, prompt_ids, sampling, request_id), session, group)

    async def score(self, ids: list[int], request_id: str, session: str | None = None) -> PromptScores:
        """A server's log-probs of `ids` (one prefill, no generation), routed, retried and watched
        for stalls like a generate call."""
        return await self._route(lambda name: self.transport.score(name, ids, request_id), session, None)

    async def _route(self, call: Callable[[str], Awaitable], session: str | None, group: str | None):
        """`call(server)` on the server the router picks, again on another after a server failure."""
        self.calls += 1
        tried: set[str] = set()
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            try:
                name = self.router.pick(session, group, exclude=tried)
            except NoHealthyServer:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(self.wait_poll_s)
                tried.clear()  # the servers this request failed on were dropped: they can only come back re-admitted
                continue
            start = time.monotonic()
            ok = False
            try:
                out = await self._answer(name, call(name))
                ok = True
                self.router.observe(name, out.server_in_flight)
                return out
            except asyncio.CancelledError:
                ok = True  # the caller gave up: not the server's failure
                raise
            except ServerFailed as failure:
                self._drop(failure)
            finally:
                self.router.done(name, ok=ok, latency_s=time.monotonic() - start)
            tried.add(name)
            self.retries += 1

    async def _answer(self, name: str, answer: Awaitable):
        """The server's answer; ServerFailed(stalled) when its engine makes no progress for stall_timeout_s."""
        call = asyncio.ensure_future(answer)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(call), self.stall_timeout_s)
                except asyncio.TimeoutError:
                    pass  # a long request: is the engine still producing tokens?
                try:
                    progress = await asyncio.wait_for(self.transport.progress(name), self.stall_timeout_s)
                except (asyncio.TimeoutError, ServerFailed):
                    raise ServerFailed(name, "stalled", f"no answer to a progress probe within {self.stall_timeout_s:g}s (a hung process)") from None
                if progress.idle_s > self.stall_timeout_s:
                    raise ServerFailed(name, "stalled", f"its engine produced no token for {progress.idle_s:.0f}s with "
                                                        f"{progress.in_flight} requests waiting (rollout.stall_timeout_s={self.stall_timeout_s:g})")
        finally:
            if not call.done():
                call.cancel()  # a stalled call, or a caller that gave up: the transport cancels it on the server

    def _drop(self, failure: ServerFailed) -> None:
        """Out of this plane's rotation now; the control plane confirms, and its answer decides."""
        name = failure.server
        if name not in self.router.ejected:
            log.warning("%s: dropping rollout server %s: %s", self.role, name, failure)
        self.router.eject(name, f"{failure.kind}: {failure.cause}")
        # Reported once: not while a report on it waits, nor once the control plane has ejected it
        # (a call that failed there before that answer can end after it).
        confirmed = self.membership is not None and name in self.membership.ejected
        if name not in self.reporting and not confirmed:
            self.reporting[name] = asyncio.get_running_loop().create_task(self._report(failure))

    async def _report(self, failure: ServerFailed) -> None:
        try:
            answer = await self.report(failure.server, failure.kind, failure.cause)
        except Exception as exc:  # the control plane is down or restarting: keep what we know, learn more on its next update
            log.warning("%s: could not report rollout server %s to the control plane (%s); it stays out of this plane's rotation "
                        "until the next membership update", self.role, failure.server, exc)
            answer = None
        finally:
            self.reporting.pop(failure.server, None)
        if answer is not None:
            if self.membership is not None and answer.incarnation == self.membership.incarnation and answer.epoch == self.membership.epoch:
                self.membership = None  # the same snapshot again, but this plane's own view changed since: apply it anyway
            self.apply(answer)

    def end_session(self, session: str) -> None:
        self.router.end_session(session)

    def stats(self) -> dict:
        return {**self.router.stats(), "calls": self.calls, "retries": self.retries,
                "membership_epoch": self.membership.epoch if self.membership else None}
