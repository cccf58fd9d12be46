"""RolloutServer: one rollout-engine replica; generate, take weights over ZMQ, sleep/wake, health."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray

from actors import deaths
from actors.metrics import RolloutMetrics
from raytool.device import set_torch_threads
from raytool.controlplane import SyncAck
from raytool.engines import EngineOptions, make_engine
from raytool.engines.crash import death, repeats, verdict
from raytool.errors import RolloutServerError, describe_engine_failure
from raytool.types import PromptScores, SamplingParams, ServerHealth, ServerProgress, TokenOutput
from raytool.weightsync import AttestationError

log = logging.getLogger(__name__)

LOAD_CHECK_S = 2.0  # while a weight load runs, how often the server checks that its engine is alive


@ray.remote
class RolloutServer:
    """Built by Ray again after its process dies (`max_restarts`): then it starts a fresh engine on
    the checkpoint it was given, opens new weight receivers, and reports policy version 0 until
    the driver re-syncs it. An engine that dies of the same exception as at the previous death
    (raytool.engines.crash.repeats) is not restarted: the server exits for good, and the driver
    ends the run with the engine's own error."""

    def __init__(self, name: str, model_path: str, engine: str, engine_options: EngineOptions, torch_threads: int = 0):
        set_torch_threads(torch_threads)
        self.name = name
        self.model_path = model_path
        self.engine_name = engine
        self.failure: str | None = None
        self.engine = None
        self.addresses: list[str] = []
        self.requests: dict[str, None] = {}  # ids of the requests in flight, oldest first
        self.stopped = False  # its engine crashed as at its previous death: exiting for good
        self.loading = False  # a weight load is running: requests are frozen on purpose
        self.started = time.time()
        try:
            self.engine = make_engine(engine, model_path, engine_options)
        except Exception as exc:  # reported by ready() in one line; the actor stays up to say why
            self.failure = describe_engine_failure(name, model_path, engine, exc)
            log.error("%s", self.failure)
        self.up_since = time.monotonic()  # the engine is up (or failed to start)
        self.metrics = RolloutMetrics(name, lambda: self.in_flight, lambda: self.engine.policy_version if self.engine else None)

    def _check(self) -> None:
        if self.failure is not None:
            raise RolloutServerError(self.failure)

    async def ready(self) -> list[str]:
        """Raise the one-line start failure, or open the weight receivers and return their addresses."""
        self._check()
        if not self.addresses:
            self.addresses = await self.engine.bind_weight_receivers(ray.util.get_node_ip_address())
        return self.addresses

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        start = time.perf_counter()
        out = await self._serve(request_id, lambda: self.engine.generate(prompt_ids, sampling, request_id))
        self.metrics.request_done(len(out.token_ids), time.perf_counter() - start)
        out.server = self.name
        out.server_in_flight = self.in_flight
        return out

    async def score(self, ids: list[int], request_id: str) -> PromptScores:
        """The engine's log-probs of `ids` under the weights it holds (one prefill): a teacher's
        word on a student's tokens."""
        if len(ids) < 2:
            raise ValueError(f"rollout server {self.name}: scoring needs at least 2 tokens, got {len(ids)}")
        logprobs = await self._serve(request_id, lambda: self.engine.prompt_logprobs(ids))
        return PromptScores(logprobs, self.name, self.engine.policy_version, self.in_flight)

    async def _serve(self, request_id: str, work):
        """Run one request on the engine (`work()`: its call), counted in flight (the stall clock
        starts when work arrives at an idle engine)."""
        self._check()
        self._exit_if_engine_died()
        if not self.requests:
            self.engine.stats.progressed()
        self.requests[request_id] = None
        try:
            return await work()
        except Exception as exc:
            self._exit_if_engine_died(exc)
            raise
        finally:
            self.requests.pop(request_id, None)

    async def receive_weights(self, version: int, timeout_s: float = 300.0, attempt: int = 0) -> SyncAck:
        """Take one weight sync from the trainer into the live engine; ack after the weights are in.
        Versions only go up: a sync older than the weights it serves is refused."""
        self._check()
        self._exit_if_engine_died()  # a dead engine would never take the weights (nor answer)
        if version < self.engine.policy_version:
            raise ValueError(f"rollout server {self.name}: weight sync v{version} is older than the v{self.engine.policy_version} "
                             "it serves (versions only go up)")
        start = time.perf_counter()
        self.loading = True
        try:
            loading = asyncio.ensure_future(self.engine.receive_weights(version, timeout_s, attempt))
            while not (await asyncio.wait({loading}, timeout=LOAD_CHECK_S))[0]:
                self._exit_if_engine_died()  # an engine that died mid-load may never answer the load
            loaded = loading.result()
        except AttestationError as exc:  # the engine serves nothing of this version: say which server
            raise AttestationError(f"{self.name}: {exc}", version=exc.version, bucket=exc.bucket, kind=exc.kind) from None
        except Exception as exc:
            self._exit_if_engine_died(exc)
            raise
        finally:
            self.loading = False
            self.engine.stats.progressed()
        return SyncAck(self.name, loaded, version, time.perf_counter() - start, self.engine.attestation)

    async def abort(self, request_id: str) -> bool:
        self._check()
        return await self.engine.abort(request_id)

    async def sleep(self) -> None:
        self._check()
        await self.engine.sleep()

    async def wake_up(self) -> None:
        self._check()
        await self.engine.wake_up()

    async def pause(self) -> None:
        """Hold new work (vLLM `keep` mode: running requests freeze too) until resume()."""
        self._check()
        await self.engine.pause()

    async def resume(self) -> None:
        self._check()
        await self.engine.resume()

    def progress(self) -> ServerProgress:
        """How long the engine has gone without a token while requests wait on it (0 while idle or
        loading weights): the control plane tells a stalled server from a busy one by it."""
        self._exit_if_engine_died()
        idle = 0.0 if self.in_flight == 0 or self.loading else time.monotonic() - self.engine.stats.progress_at
        return ServerProgress(self.name, self.in_flight, idle)

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def _exit_if_engine_died(self, exc: BaseException | None = None) -> None:
        """An engine that died inside this live actor (vLLM's engine core process is gone) would
        fail every call while Ray sees a healthy actor: exit the process instead, so Ray restarts
        the server (`rollout.max_restarts`) with a fresh engine, which the next sync re-loads.
        Unless it died of the same exception as at its previous death: then it exits for good
        (a restart would only replay the crash), leaving the driver its one line."""
        if self.engine is None or not self.engine.dead(exc):
            return
        if self.stopped:  # already exiting for good (a caller caught the exit and asked again)
            ray.actor.exit_actor()
        actor_id = ray.get_runtime_context().get_actor_id()
        now = death(self.engine.crash(), self.up_since, list(self.requests))
        previous = deaths.last_death(actor_id)
        deaths.record_death(actor_id, now)
        if repeats(previous, now):
            line = verdict(self.name, now)
            log.error("%s\n%s", line, now.crash.traceback)
            deaths.mark_stopped(actor_id, line)
            self.stopped = True
            ray.actor.exit_actor()  # an intended exit: Ray does not restart it
        cause = now.crash.one_line() if now.crash else (exc or "engine core gone")
        log.error("rollout server %s: its engine died (%s); exiting so Ray restarts the server", self.name, cause)
        if now.crash:
            log.error("%s", now.crash.traceback)
        logging.shutdown()
        os._exit(1)

    def health(self) -> ServerHealth:
        """Cheap liveness and state probe (the control plane re-admits on it); raises if the engine failed."""
        self._check()
        self._exit_if_engine_died()
        return ServerHealth(self.name, self.engine.policy_version, self.in_flight, time.time() - self.started, os.getpid())

    async def receivers(self) -> list[str]:
        """health's checks, then where this process's weight receivers listen (what a sync sends to)."""
        self._check()
        self._exit_if_engine_died()
        return await self.ready()

    def stats(self) -> dict:
        self._check()
        return {"server": self.name, "model": self.model_path, "engine": self.engine_name, "in_flight": self.in_flight,
                **self.engine.engine_stats()}

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
