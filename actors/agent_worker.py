"""AgentLoopWorker: runs many trajectories concurrently (one asyncio task each) and scores them.

Failures around a trajectory are recorded on it, not raised: a sandbox pool that died (the call
raises; Ray restarts the pool) or lost the trajectory's session is a `sandbox_error` the loop turns
into `infra_failed`; a scoring call that raises or scores longer than `reward.call_timeout_s` (its
time queued behind other calls aside) is tried on the next reward worker after a backoff,
`reward.retries` times, and then marks the trajectory infra-failed with the cause. The driver
rolls such a group out again (`rollout.max_group_retries`), and this worker waits a backoff before
a retry's rollout (raytool.overload). Each trajectory records, per stage, the seconds its calls
queued and were served (`Trajectory.timings`: reward_queue_s, reward_s, sandbox_queue_s, sandbox_s).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
import uuid
import zlib
from functools import partial

import msgspec
import ray

from actors.common import named, until_alive
from actors.dataplane import data_plane, follow
from raytool.agent.loop import reward_view
from raytool.agent.registry import get_agent_loop, loop_hooks
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, RolloutConfig, RunConfig
from raytool.distill import TeacherEndpoint, teacher_logprobs
from raytool.errors import one_line
from raytool.models import load_tokenizer
from raytool.overload import backoff_s, stage_timing
from raytool.streaming import trajectory_stats
from raytool.tools.code_interpreter import CodeInterpreterTool
from raytool.tools.registry import ToolSet, load_tool_config
from raytool.types import Message, TrainSequence, Trajectory, trained

log = logging.getLogger(__name__)


def build_toolset(agent: AgentConfig, tokenizer, executor) -> ToolSet:
    """The tools of a run: the verl-format YAML named by agent.tools, or the code interpreter alone."""
    if agent.tools:
        return load_tool_config(agent.tools, code_executor=executor, tokenizer=tokenizer, max_output_tokens=agent.tool_output_tokens)
    return ToolSet([CodeInterpreterTool(executor, tokenizer=tokenizer, max_output_tokens=agent.tool_output_tokens)])


@ray.remote
class AgentLoopWorker:
    def __init__(self, model_path: str, manager, servers: list[str], sandbox_pools: list, reward_workers: list, cfg: RunConfig,
                 namespace: str | None = None, role: str = "agent-worker", teacher: tuple | None = None):
        """`manager`, `sandbox_pools`, `reward_workers`: handles, or names in `namespace` (see
        actors.common.named); `servers`: the rollout servers' names, which this worker's data plane
        calls directly (the manager, the control plane, says which of them serve). `teacher`
        (distill.teacher): the teacher's control plane and servers, (manager, [server names]),
        which a second data plane calls the same way; a teacher URL is called directly."""
        for module in cfg.agent.loop_modules:  # where users register their own loops and tools
            importlib.import_module(module)
        self.cfg = cfg
        self.manager = named(manager, namespace)
        self.plane = data_plane(dict(zip(servers, named(servers, namespace))), self.manager, cfg.rollout, role)
        # Ray runs an async actor's constructor in its event loop: membership follows from now on.
        self._following = asyncio.get_running_loop().create_task(follow(self.plane, self.manager))
        self.teacher = None
        if cfg.distill.url is not None:  # a teacher URL: its API routes
            self.teacher = TeacherEndpoint(cfg.distill)
        elif teacher is not None:
            teacher_manager = named(teacher[0], namespace)
            self.teacher = data_plane(dict(zip(teacher[1], named(teacher[1], namespace))), teacher_manager, cfg.rollout, f"{role} (teacher)")
            self._following_teacher = asyncio.get_running_loop().create_task(follow(self.teacher, teacher_manager))
        self.sandbox_pools = named(sandbox_pools, namespace)
        self.reward_workers = itertools.cycle(named(reward_workers, namespace))
        # Sandbox sessions are named per attempt of a trajectory and per worker process, so a group
        # rolled out again (here, or after this worker was restarted) never meets its earlier state.
        self.nonce = uuid.uuid4().hex[:8]
        self.sessions: dict[str, str] = {}  # trajectory id -> its sandbox session
        self.started: set[str] = set()  # sessions that have run a cell
        self.sandbox_times: dict[str, list[float]] = {}  # trajectory id -> [seconds its cells queued, seconds they ran]
        self.tokenizer = load_tokenizer(model_path)
        self.toolset = build_toolset(cfg.agent, self.tokenizer, self._execute)
        self.renderers: dict[tuple, ChatRenderer] = {}  # one per distinct tool set of the rows (hermes lists it in the prompt)
        self._renderer(list(self.toolset.tools.values()))  # rows without tools: built now, so a template that cannot render fails at start
        self.slots = asyncio.Semaphore(cfg.agent.max_concurrent_trajectories)
        get_agent_loop(cfg.agent.default_agent)  # an unknown default fails now, not on the first row

    def _renderer(self, tools: list) -> ChatRenderer:
        key = tuple(t.name for t in tools) if self.cfg.agent.format != "retool" else ()
        if key not in self.renderers:
            self.renderers[key] = ChatRenderer(self.tokenizer, tools=[t.schema for t in tools] if self.cfg.agent.format != "retool" else None,
                                               template_kwargs=self.cfg.agent.chat_template_kwargs, fmt=self.cfg.agent.format)
        return self.renderers[key]

    def _pool(self, session: str):
        # A stable hash: every cell of a trajectory reaches the pool that holds its session.
        return self.sandbox_pools[zlib.crc32(session.encode()) % len(self.sandbox_pools)]

    async def _execute(self, code: str, uid: str):
        session = self.sessions.get(uid, uid)
        continuing = session in self.started
        self.started.add(session)
        pool = self._pool(session)
        try:
            result = await pool.execute.remote(code, session, continuing)
        except ray.exceptions.RayActorError:
            # The pool died: Ray restarts it. A session's first cell runs again there; a later cell's
            # interpreter state is gone, which the tool answers as a sandbox error (infra-failed).
            if continuing or not await until_alive(pool):
                raise
            result = await pool.execute.remote(code, session, False)
        times = self.sandbox_times.setdefault(uid, [0.0, 0.0])
        times[0] += result.queue_s
        times[1] += result.duration_s
        return result

    async def _score(self, traj: Trajectory, ground_truth: str, extra: dict) -> None:
        """Score `traj` on the next reward worker; a call that raises or scores longer than
        reward.call_timeout_s (the worker times the scoring, not the wait for its slot) is tried
        again on the next one after a backoff, up to reward.retries times, then the trajectory is
        infra-failed. A worker that hangs whole is the watchdog's (actors.drivers.watchdog): it is killed
        and the call raises."""
        r = self.cfg.reward
        view = reward_view(traj, self.cfg.agent.max_response_tokens, partial(self.tokenizer.decode, skip_special_tokens=True))
        for attempt in range(r.retries + 1):
            if attempt:
                await asyncio.sleep(backoff_s(attempt))
            worker = next(self.reward_workers)
            try:
                traj.reward, traj.reward_extra, (waited, served) = await worker.score.remote(view, ground_truth, extra, r.call_timeout_s)
                traj.timings = {**traj.timings, **stage_timing("reward", waited, served)}
                return
            except ray.exceptions.RayActorError as exc:  # the worker died: Ray restarts it
                cause = one_line(exc)
                await until_alive(worker)
            except Exception as exc:  # the fn raised (a RewardError naming it)
                cause = one_line(exc)
            log.warning("scoring %s failed (attempt %d of %d): %s", traj.uid, attempt + 1, r.retries + 1, cause)
        traj.infra_failure, traj.finish_reason = f"reward: {cause}", "infra_failed"

    async def _one(self, messages: list[Message], ground_truth: str, uid: str, group_id: str, agent_name: str,
                   extra: dict, rollout: RolloutConfig, attempt: int, teach: bool = True) -> Trajectory:
        async def generate(prompt_ids, sampling, request_id, session):
            # Cancelled past agent.max_trajectory_s, the data plane cancels the call on its server too.
            return await self.plane.generate(prompt_ids, sampling, request_id, session, group_id)

        # The row's tools (extra["tools"]: names; None: all), created with its verl tools_kwargs, and their renderer.
        tools = self.toolset.for_row(extra.get("tools"), (extra.get("extra_info") or {}).get("tools_kwargs"))
        loop_class = get_agent_loop(agent_name)
        hooks = loop_hooks(loop_class)
        loop = loop_class(self._renderer(list(tools.values())), tools, generate, self.cfg.agent, rollout)
        session = self.sessions[uid] = f"{uid}@{self.nonce}.{attempt}"
        async with self.slots:
            try:
                if hooks.row_extra:  # a loop that reads the row's extra (verifiers: the environment's input)
                    traj = await loop.run(messages, ground_truth, uid, group_id, extra=extra)
                else:
                    traj = await loop.run(messages, ground_truth, uid, group_id)
            finally:  # whatever happened, the trajectory's interpreter and routing state are released
                self.plane.end_session(uid)
                del self.sessions[uid]
                cells = self.sandbox_times.pop(uid, None)
                if session in self.started:
                    self.started.discard(session)
                    self._pool(session).close_session.remote(session)
        traj.agent_name = agent_name
        if cells is not None:
            traj.timings = {**traj.timings, **stage_timing("sandbox", *cells)}
        # Score now, while sibling trajectories are still rolling out; one stopped by its wall-clock
        # limit is truncated, not answered: it is not scored (nor trained: raytool.types.trained).
        if not traj.infra_failure and trained(traj.finish_reason):
            await asyncio.gather(*([] if hooks.scored_by_loop else [self._score(traj, ground_truth, extra)]),
                                 *([self._teach(traj)] if self.teacher is not None and teach else []))
        return traj

    async def _teach(self, traj: Trajectory) -> None:
        """distill.teacher: the teacher's log-prob of every response token, from one scoring call over
        the whole sequence on a teacher server (routed, retried and watched like a generate call) or
        the teacher URL (raytool.distill.TeacherEndpoint); a
        teacher that fails or answers wrong infra-fails the trajectory with the cause (its group is
        rolled out again)."""
        start = time.monotonic()
        try:
            scores = await self.teacher.score(traj.prompt_ids + traj.response_ids, f"{traj.uid}-teacher", traj.uid)
            traj.teacher_logprobs = teacher_logprobs(len(traj.prompt_ids), traj.response_mask, scores.logprobs)
        except Exception as exc:  # the teacher's side failed, not the policy (NoHealthyServer, InvalidRequest, a wrong answer)
            traj.infra_failure, traj.finish_reason = f"teacher: {one_line(exc)}", "infra_failed"
        traj.timings = {**traj.timings, **stage_timing("teacher", 0.0, time.monotonic() - start)}

    @ray.method(num_returns=3)
    async def run_group(self, messages: list[Message], ground_truth: str, group_id: str, n: int, agent_name: str | None = None,
                        extra: dict | None = None, sampling: dict | None = None, attempt: int = 0, teach: bool = True):
        """n samples of one prompt (a GRPO group) -> (trajectories, their small stats, what the
        trainer trains on of each: three objects, so that each reader fetches only its own).
        `extra` goes to the reward fn (data_source, extra_info); `sampling` overrides rollout keys
        (validation samples with its own temperature); `attempt`: how many times the group was
        rolled out before (same ids, so the same sampling seeds); `teach`: with distill.teacher, the
        teacher scores each trajectory (validation's are not trained: not scored)."""
        name = agent_name or self.cfg.agent.default_agent
        extra = extra or {}
        rollout = msgspec.structs.replace(self.cfg.rollout, **sampling) if sampling else self.cfg.rollout
        hooks = loop_hooks(get_agent_loop(name))
        uids = [f"{group_id}/{i}" for i in range(n)]
        await asyncio.sleep(backoff_s(attempt))  # a retry after an infrastructure failure does not come back at once
        try:
            trajs = await asyncio.gather(*(self._one(messages, ground_truth, uid, group_id, name, extra, rollout, attempt, teach) for uid in uids))
            if hooks.score_group is not None:  # a loop whose environment scores its groups together (verifiers' rubric)
                await hooks.score_group(list(trajs), self.cfg.reward.call_timeout_s)
        finally:
            if hooks.forget is not None:
                hooks.forget(uids)
        return list(trajs), [trajectory_stats(t) for t in trajs], [TrainSequence.of(t) for t in trajs]
