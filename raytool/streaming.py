"""The streaming rollout core (no Ray here): GRPO groups flow from the agent workers into a buffer,
the trainer takes `data.prompts_per_step` of them per step, and admission control keeps the
groups running or buffered ahead of the trainer within `async.max_staleness` policy versions.

The synchronous loop is the special case `max_staleness: 0`: a step's prompts are drawn and
rolled out, the trainer waits for all of them, nothing new starts while it trains, and the next
prompts start on the new weights.

Admission, with P = data.prompts_per_step and k = async.max_staleness:
- a wave of P prompts starts when the groups running, buffered and being trained leave room for
  a whole wave within (k + 1) * P. A wave admitted while the trainer is at version V is trained at
  version V + k at the latest, so its tokens lag by at most k (groups finish out of order: one
  that is still older than that when the trainer would take it is dropped and counted);
- when nothing runs and the trainer still waits for groups (dynamic sampling filtered some, or
  stale ones were dropped), another wave starts: dynamic sampling's next round, at most
  `algorithm.max_sampling_rounds` per step.

Groups are taken in the order they were submitted, so a step's batch does not depend on which
group finished first.

Infrastructure failures are never trained as the policy's mistakes. A group that comes back with
an infra-failed trajectory (`Trajectory.infra_failure`), or not at all (its agent worker died:
`GroupFailed`), is rolled out again under the same key, so with the same sampling seeds, up to
`max_retries` times; after that it is recorded as failed with its cause and the step trains on the
groups it has (no replacement wave is drawn for it). Groups failing again and again without one
succeeding stop the run with the cause, instead of rolling out forever.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from raytool.distill import reverse_kl, tool_turn_agreement
from raytool.errors import RaytoolError
from raytool.overload import STAGES, AdmissionWindow, stage_times
from raytool.types import Trajectory, accuracy, generated_versions, trained

log = logging.getLogger(__name__)


class TrajectoryStats(msgspec.Struct, frozen=True):
    """The small per-trajectory summary the driver keeps (the trajectories stay in the object store)."""

    reward: float
    acc: float
    response_length: int
    generated_tokens: int
    num_turns: int
    tool_calls: int
    tool_errors: int
    tool_error_kinds: dict[str, int]
    tool_repaired: int
    tool_cut_in_fence: int
    finish_reason: str
    verify_timeout: float  # 1.0 when the answer's check ran out of time (scored wrong)
    infra_failure: str  # why infrastructure failed it ("": it did not)
    min_version: int
    max_version: int
    version_counts: dict[int, int]  # generated tokens per policy version
    group: int = -1  # the index of its group, in a batch or a rollout's rows (-1: not placed yet)
    scores: dict[str, float] = {}  # the reward fn's other numbers (reward_extra: each verifiers reward function's value, the judge's score)
    stages: dict[str, tuple[float, float]] = {}  # per stage it used (raytool.overload.STAGES): (seconds queued, seconds served)
    reverse_kl: float | None = None  # distill.teacher: mean log p_student - log p_teacher over its generated tokens
    tool_turn_agreement: float | None = None  # distill.teacher: raytool.distill.tool_turn_agreement (None: no tool-call turn)
    teacher_share: float | None = None  # distill.teacher: the teacher's call's share of the trajectory's time (its rollout, then that call)


def trajectory_stats(t: Trajectory) -> TrajectoryStats:
    counts = dict(Counter(generated_versions(t)))
    return TrajectoryStats(
        reward=float(t.reward), acc=accuracy(t.reward, t.reward_extra)[0], response_length=len(t.response_ids),
        generated_tokens=sum(t.response_mask), num_turns=t.num_turns, tool_calls=t.tool_calls, tool_errors=t.tool_errors,
        tool_error_kinds=dict(t.tool_error_kinds), tool_repaired=t.tool_repaired, tool_cut_in_fence=t.tool_cut_in_fence,
        finish_reason=t.finish_reason, verify_timeout=float(t.reward_extra.get("verify_timeout", 0.0)), infra_failure=t.infra_failure,
        min_version=min(counts, default=t.policy_version), max_version=max(counts, default=t.policy_version), version_counts=counts,
        scores={k: float(v) for k, v in t.reward_extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("acc", "verify_timeout")},
        stages=stage_times(t.timings),
        **(distill_stats(t) if t.teacher_logprobs is not None else {}),
    )


def distill_stats(t: Trajectory) -> dict:
    teacher_s = t.timings.get("teacher_s", 0.0)
    return {"reverse_kl": reverse_kl(t.rollout_logprobs, t.teacher_logprobs, t.response_mask),
            "tool_turn_agreement": tool_turn_agreement(t.rollout_logprobs, t.teacher_logprobs, t.response_mask),
            "teacher_share": teacher_s / max(teacher_s + t.timings.get("total_s", 0.0), 1e-9)}


def rollout_metrics(stats: list[TrajectoryStats]) -> dict:
    """A step's rollout metrics from its trajectories' stats."""
    n = len(stats)
    calls = sum(s.tool_calls for s in stats)
    scored = [s for s in stats if trained(s.finish_reason)]  # a time-limited trajectory is not scored (finish/time_limit counts it)
    metrics = {
        "reward/mean": sum(s.reward for s in scored) / max(len(scored), 1),
        "acc/mean": sum(s.acc for s in scored) / max(len(scored), 1),
        "response_length/mean": sum(s.response_length for s in stats) / n,
        "generated_tokens/mean": sum(s.generated_tokens for s in stats) / n,
        "num_turns/mean": sum(s.num_turns for s in stats) / n,
        "tool/calls_per_traj": calls / n,
        "tool/error_rate": sum(s.tool_errors for s in stats) / calls if calls else 0.0,
        "rollout/trajectories": n,
    }
    # Counts per step, by kind (raytool.tools.base.ERROR_KINDS), as a rate per call.
    for kind in sorted({k for s in stats for k in s.tool_error_kinds}):
        metrics[f"tool/errors/{kind}"] = sum(s.tool_error_kinds.get(kind, 0) for s in stats) / max(calls, 1)
    metrics["tool/repaired"] = sum(s.tool_repaired for s in stats)
    metrics["tool/cut_in_fence"] = sum(s.tool_cut_in_fence for s in stats)
    metrics["reward/timeouts"] = sum(s.verify_timeout for s in stats)  # answers whose check ran out of time (scored wrong)
    for name in sorted({k for s in stats for k in s.scores}):  # each reward function's mean over the trajectories it scored
        scored = [s.scores[name] for s in stats if name in s.scores]
        metrics[f"reward/fn/{name}"] = sum(scored) / len(scored)
    for reason in sorted({s.finish_reason for s in stats}):
        metrics[f"finish/{reason}"] = sum(s.finish_reason == reason for s in stats) / n
    for key in ("reverse_kl", "tool_turn_agreement", "teacher_share"):
        known = [v for s in stats if (v := getattr(s, key)) is not None]
        if known:  # distill.teacher: the student's distance to the teacher on its own samples, and the teacher's time
            metrics[f"distill/{'rollout_' if key == 'reverse_kl' else ''}{key}"] = sum(known) / len(known)
    for stage in STAGES:  # time queued for the stage apart from time served (raytool.overload)
        used = [s.stages[stage] for s in stats if stage in s.stages]
        if used:
            metrics[f"stage/{stage}/queue_s"] = sum(q for q, _ in used) / len(used)
            metrics[f"stage/{stage}/service_s"] = sum(t for _, t in used) / len(used)
    return metrics


@dataclass(frozen=True)
class GroupRefs:
    """Where a finished group's outputs wait in the object store (object refs in the Ray layer),
    each fetched only by who reads it: its trajectories (the record: traces, checkpoints,
    validation) and its `TrainSequence`s (what the trainer ranks train on)."""

    trajectories: Any
    sequences: Any


@dataclass
class RolloutGroup:
    """One finished GRPO group: n scored samples of one prompt."""

    key: str  # the group id (its trajectories' ids and sampling seeds derive from it)
    seq: int  # submission order
    row: Any  # the prompt row (a PromptRow): what a resume rolls out again
    ref: Any  # its outputs in the object store (GroupRefs)
    stats: list[TrajectoryStats]  # of each sample
    submitted_version: int  # the trainer's version when the group started

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.stats)

    @property
    def max_version(self) -> int:
        return max(s.max_version for s in self.stats)

    def rewards_vary(self) -> bool:
        """Whether its trained samples scored differently: under GRPO an all-equal group has zero
        advantage (a time-limited sample counts in neither the loss nor the group's statistics)."""
        return len({s.reward for s in self.stats if trained(s.finish_reason)}) > 1


@dataclass
class RolloutBatch:
    """What one training step takes: groups in submission order, with the trainer's version then."""

    groups: list[RolloutGroup]
    version: int

    def stats(self) -> list[TrajectoryStats]:
        """Every trajectory's stats, each with the index of its group in this batch."""
        return [msgspec.structs.replace(s, group=i) for i, g in enumerate(self.groups) for s in g.stats]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for g in self.groups for s in g.stats]

    @property
    def trained(self) -> list[bool]:
        """Whether each trajectory takes part in the update (raytool.types.trained)."""
        return [trained(s.finish_reason) for g in self.groups for s in g.stats]

    @property
    def group_index(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) for _ in g.stats]

    @property
    def offsets(self) -> list[int]:
        """Position of each group's first trajectory in the flat batch."""
        out, at = [], 0
        for g in self.groups:
            out.append(at)
            at += len(g.stats)
        return out

    def lengths(self) -> list[list[int]]:
        """Per group, each trajectory's trained length (prompt-free response plus one; 1 for one the
        update leaves out), by which the ranks' shares are balanced."""
        return [[s.response_length + 1 if trained(s.finish_reason) else 1 for s in g.stats] for g in self.groups]

    def staleness_metrics(self) -> dict:
        """How far behind the trainer's version the batch's tokens and trajectories are."""
        tokens = lag_sum = lag_max = 0
        for g in self.groups:
            for s in g.stats:
                for v, n in s.version_counts.items():
                    tokens += n
                    lag_sum += (self.version - v) * n
                    lag_max = max(lag_max, self.version - v)
        trajs = [self.version - s.min_version for g in self.groups for s in g.stats]
        return {
            "staleness/token_mean": lag_sum / tokens if tokens else 0.0,
            "staleness/token_max": lag_max,
            "staleness/traj_mean": sum(trajs) / len(trajs) if trajs else 0.0,
            "staleness/traj_max": max(trajs, default=0),
        }


STALE_DROPS_PER_STEP = 4  # batches' worth of groups dropped as stale in one step before the run stops: servers not being synced


@dataclass
class GroupFailed:
    """What `wait` reports for a group that produced no result (its agent worker died): the cause."""

    cause: str


def group_failure(stats: list[TrajectoryStats] | GroupFailed) -> str:
    """Why a finished group cannot be trained as it is ("": it can)."""
    if isinstance(stats, GroupFailed):
        return f"agent worker: {stats.cause}"
    return next((s.infra_failure for s in stats if s.infra_failure), "")


RETRY_BUDGET_FLOOR = 4  # retries a step may always spend, however few its groups


def stage_of(cause: str) -> str:
    """The stage an infrastructure failure's cause names: its prefix (`reward`, `sandbox`,
    `generate`, `agent worker`), or `other`."""
    head, sep, _ = cause.partition(":")
    return head.strip() if sep and head.strip() else "other"


@dataclass
class GroupRetries:
    """The one retry policy for GRPO groups, used by the training stream and by Graph.rollout
    (validation, `raytool eval`, benches): a group whose infrastructure failed (a trajectory
    infra-failed, or its agent worker died: `group_failure`) is rolled out again under the same key,
    so with the same sampling seeds, until it has been rolled out 1 + `max_retries` times
    (`rollout.max_group_retries`). What a group still failing then means is the caller's: training
    leaves it out of the loss; a rollout that must return every group keeps its infra-failed
    trajectories as they are, and stops with the cause when it has none (its worker kept dying).

    Retries spend a budget, so that they cannot multiply the load on a stage that is failing
    because it is overloaded: within one period (a training step; one `Graph.rollout`) at most
    `budget` x the groups started in it (`rollout.retry_budget`, never fewer than RETRY_BUDGET_FLOOR)
    are rolled out again; past that a failing group has failed. The agent workers wait before a
    retry's rollout (raytool.overload.backoff_s)."""

    max_retries: int
    budget: float = 1.0
    started: int = 0  # groups started in this period (retries aside)
    spent: int = 0  # retries started in this period
    refused: int = 0  # retries the budget refused in this period
    seen: int = 0  # rollouts that came back in this period
    failures: Counter = field(default_factory=Counter)  # of those, infra-failed, by stage (stage_of)

    def new_period(self) -> None:
        self.started = self.spent = self.refused = self.seen = 0
        self.failures = Counter()

    @property
    def allowed(self) -> int:
        return max(RETRY_BUDGET_FLOOR, int(self.budget * self.started))

    def verdict(self, attempt: int, result: list[TrajectoryStats] | GroupFailed) -> tuple[str, str]:
        """(`ok` | `retry` | `failed`, the cause) for a group's `attempt`-th rollout (0: the first)."""
        self.seen += 1
        cause = group_failure(result)
        if not cause:
            return "ok", ""
        self.failures[stage_of(cause)] += 1
        if attempt >= self.max_retries:
            return "failed", cause
        if self.spent >= self.allowed:
            self.refused += 1
            return "failed", f"{cause} (not rolled out again: this step's retry budget, rollout.retry_budget={self.budget:g}, is spent: {self.spent} retries)"
        self.spent += 1
        return "retry", cause

    def error_rate(self, cause: str) -> str:
        """The failing stage of `cause` and how often it failed in this period, in words."""
        stage = stage_of(cause)
        return f"the {stage} stage failed {self.failures[stage]} of {self.seen} rollouts that came back in this step"

    def log_retry(self, key: str, attempt: int, cause: str) -> None:
        log.warning("group %s: %s; rolling it out again (retry %d of %d)", key, cause, attempt + 1, self.max_retries)


@dataclass
class _Running:
    key: str
    seq: int
    row: Any
    ref: Any
    version: int
    attempt: int = 0  # rollouts of this group before this one (infrastructure failures)


def _no_outcomes() -> dict:
    return {"drawn": [], "trained": [], "dropped": {}, "failed": {}}


@dataclass
class _Clock:
    """Time with no group running (rollout idle) and time the trainer waits for a batch."""

    rollout_idle_s: float = 0.0
    trainer_wait_s: float = 0.0
    since: float = field(default_factory=time.perf_counter)
    idle: bool = True

    def mark(self, running: bool) -> None:
        now = time.perf_counter()
        if self.idle:
            self.rollout_idle_s += now - self.since
        self.since, self.idle = now, not running

    def lap(self) -> tuple[float, float]:
        """(rollout idle, trainer wait) seconds since the last lap."""
        self.mark(not self.idle)
        out = (self.rollout_idle_s, self.trainer_wait_s)
        self.rollout_idle_s = self.trainer_wait_s = 0.0
        return out


class RolloutStream:
    """Admission, the buffer of finished groups and the per-step batch (see the module docstring).

    `submit(row, key, attempt) -> (trajectories ref, stats ref)` starts one group (`attempt`: its
    earlier rollouts); `wait(stats refs, also)` blocks until at least one of them or of `also` is
    ready and returns ({stats ref: stats, or GroupFailed} of the finished groups, the ready refs of
    `also`). `draw()` returns the next P prompt rows."""

    def __init__(self, per_step: int, max_staleness: int, draw: Callable[[], list], submit: Callable, wait: Callable,
                 dynamic_sampling: bool = False, max_rounds: int = 1, policy_version: Callable[[], int] = lambda: 0, max_retries: int = 2,
                 retry_budget: float = 1.0, window: AdmissionWindow | None = None):
        self.per_step, self.k = per_step, max_staleness
        self.draw, self.submit, self.wait = draw, submit, wait
        self.dynamic, self.max_rounds = dynamic_sampling, max_rounds
        self.retries = GroupRetries(max_retries, retry_budget)
        self.window = window or AdmissionWindow(1 << 30)  # groups in flight at once (raytool.overload): unbounded by default
        self.queued: list[_Running] = []  # admitted, waiting for room in the window
        self.failed_in_a_row = 0  # groups failed for good since one succeeded
        self.failed_unreplaced = 0  # groups failed for good since the last batch was taken: the batch goes without them
        self.policy_version = policy_version  # asked of its owner (the control plane) each time: see `version`
        self.running: dict[Any, _Running] = {}  # stats ref -> group
        self.done: list[RolloutGroup] = []  # finished and kept, not yet trained
        self.redo: list[tuple[str, Any]] = []  # (key, row) to roll out before drawing new prompts (resume)
        self.training = False  # a batch is being trained: it still counts as ahead of the trainer
        self.step = 0
        self.waves = 0  # waves started in this step
        self.seq = 0
        self.clock = _Clock()
        self.on_finished: Callable[[int], Any] | None = None  # told the trajectories of each group that finishes (a progress bar)
        self.outcomes: dict = _no_outcomes()  # for the ledger, since the last entry
        self._reset_step_counts()

    def _reset_step_counts(self) -> None:
        self.finished: list[RolloutGroup] = []  # everything that finished during this step (metrics)
        self.filtered: list[RolloutGroup] = []  # dropped by dynamic sampling during this step
        self.dropped_stale = 0
        self.retried = 0  # rollouts started again after an infrastructure failure
        self.failed = 0  # groups failed for good
        self.trajs_infra_failed = 0  # infra-failed trajectories among the groups that came back
        self.retries.new_period()

    # -- admission ----------------------------------------------------------------------------

    def _ahead(self) -> int:
        return len(self.running) + len(self.queued) + len(self.done) + (self.per_step if self.training else 0)

    def _start_wave(self) -> None:
        self.waves += 1
        rows = [self.redo.pop(0) for _ in range(min(len(self.redo), self.per_step))]
        if not rows:
            rows = [(f"s{self.step}r{self.waves}g{i}", row) for i, row in enumerate(self.draw())]
            self.outcomes["drawn"] += [key for key, _ in rows]
        version = self.version
        for key, row in rows:
            self.queued.append(_Running(key, self.seq, row, None, version))
            self.seq += 1
        self.retries.started += len(rows)
        self._pump()
        self.clock.mark(True)

    def _pump(self) -> None:
        """Start the admitted groups the admission window has room for, oldest first."""
        admitted = self.window.admit(len(self.running), len(self.queued))
        version = self.version if admitted else None
        for _ in range(admitted):
            group = self.queued.pop(0)
            group.version = version  # what it starts on
            group.ref, stats_ref = self.submit(group.row, group.key, group.attempt)
            self.running[stats_ref] = group

    def _needed(self) -> int:
        """Groups the next batch waits for: P, less those that failed for good since the last batch."""
        return max(1, self.per_step - self.failed_unreplaced)

    def fill(self, waiting: bool = False) -> None:
        """Start every wave admission allows now; `waiting`: the trainer is waiting for groups."""
        while self._ahead() + self.per_step <= (self.k + 1) * self.per_step and self._may_start():
            self._start_wave()
        if waiting and not self.running and not self.queued and len(self.done) < self._needed() and self._may_start():
            self._start_wave()

    def _may_start(self) -> bool:
        return not self.dynamic or self.waves < self.max_rounds

    # -- collection ---------------------------------------------------------------------------

    def _collect(self, also: list = ()) -> set:
        """Take in the groups that finished (waiting for one, or for one of `also`); returns the ready refs of `also`."""
        finished, ready = self.wait(list(self.running), list(also))
        for ref, stats in finished.items():
            r = self.running.pop(ref)
            self.window.finished([] if isinstance(stats, GroupFailed) else [s.stages for s in stats], len(self.running))
            verdict, cause = self.retries.verdict(r.attempt, stats)
            if verdict != "ok":
                self._failed(r, verdict, cause, stats)
                continue
            self.failed_in_a_row = 0
            group = RolloutGroup(r.key, r.seq, r.row, r.ref, stats, r.version)
            self.finished.append(group)
            if self.on_finished is not None:
                self.on_finished(len(stats))
            if self.dynamic and not group.rewards_vary():
                self.filtered.append(group)
                self._dropped("zero_variance", [group])
            else:
                self.done.append(group)
        self._pump()
        self.clock.mark(bool(self.running))
        return set(ready)

    def _failed(self, r: _Running, verdict: str, cause: str, stats: list[TrajectoryStats] | GroupFailed) -> None:
        """A group an infrastructure failure hit: roll it out again (same key, so the same seeds, on the
        current weights), or after max_retries record it as failed and leave it out of the loss."""
        if not isinstance(stats, GroupFailed):
            self.trajs_infra_failed += sum(bool(s.infra_failure) for s in stats)
        if verdict == "retry":
            self.retried += 1
            self.retries.log_retry(r.key, r.attempt, cause)
            self.queued.insert(0, _Running(r.key, r.seq, r.row, None, self.version, r.attempt + 1))
            return
        log.warning("group %s failed after %d rollouts, left out of the loss: %s", r.key, r.attempt + 1, cause)
        self.failed += 1
        self.failed_unreplaced += 1
        self.failed_in_a_row += 1
        self.outcomes["failed"][r.key] = cause
        if self.failed_in_a_row >= 2 * self.per_step:
            raise RaytoolError(f"raytool: {self.failed_in_a_row} prompt groups in a row failed for infrastructure reasons "
                               f"(rollout.max_group_retries={self.retries.max_retries}); {self.retries.error_rate(cause)}; the last: {cause}")

    def _drop_stale(self) -> None:
        if not self.done:
            return
        version = self.version
        stale = [g for g in self.done if version - g.min_version > self.k]
        if stale:
            self.dropped_stale += len(stale)
            self._dropped("stale", stale)
            self.done = [g for g in self.done if version - g.min_version <= self.k]
            if self.dropped_stale >= STALE_DROPS_PER_STEP * self.per_step:
                raise RaytoolError(f"raytool: step {self.step}: {self.dropped_stale} groups came back stale, generated on weights more than "
                                   f"async.max_staleness={self.k} versions behind the trainer's v{version} (the newest: v{max(g.min_version for g in stale)}): "
                                   "the rollout servers are not getting the weight syncs")

    def _dropped(self, reason: str, groups: list[RolloutGroup]) -> None:
        if groups:
            self.outcomes["dropped"].setdefault(reason, []).extend(g.key for g in groups)

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict]:
        """Wait until P fresh groups are finished (starting what admission allows meanwhile) and
        take them -> (the batch, metrics of this step's rollout side)."""
        if step != self.step:
            self.step, self.waves = step, 0
        start = time.perf_counter()
        while True:
            self._drop_stale()
            self.fill(waiting=True)
            if len(self.done) >= self._needed() or not self.running:
                break
            self._collect()
        self.clock.trainer_wait_s += time.perf_counter() - start
        self.done.sort(key=lambda g: g.seq)
        taken, self.done = self.done[: self.per_step], self.done[self.per_step :]
        self.failed_unreplaced = 0
        gave_up_empty = not taken
        if gave_up_empty and not self.filtered:
            raise RaytoolError(f"raytool: step {step}: no group to train on: every group of the step failed "
                               f"(rollout.max_group_retries={self.retries.max_retries}); see the warnings above for the causes")
        if gave_up_empty:  # nothing to learn from in any round: train on the last wave (its advantages are all zero)
            unrecorded = self.outcomes["dropped"].get("zero_variance", [])  # not yet in a ledger entry
            taken = [g for g in sorted(self.filtered, key=lambda g: g.seq) if g.key in unrecorded][-self.per_step :]
            if not taken:
                raise RuntimeError(f"step {step}: no group to train on (algorithm.max_sampling_rounds={self.max_rounds} waves, every group dropped)")
            self.outcomes["dropped"]["zero_variance"] = [k for k in unrecorded if k not in {g.key for g in taken}]
        self.outcomes["trained"] += [g.key for g in taken]
        metrics = self._metrics(taken, kept=0 if gave_up_empty else len(taken))
        self._reset_step_counts()
        self.training = True
        return RolloutBatch(taken, self.version), metrics

    def _metrics(self, taken: list[RolloutGroup], kept: int) -> dict:
        everything = self.finished if self.dynamic else taken
        metrics = rollout_metrics([s for g in everything for s in g.stats])
        if self.dynamic:
            metrics.update({"rollout/sampling_rounds": self.waves, "rollout/prompts_drawn": self.waves * self.per_step, "rollout/groups_kept": kept})
        metrics.update(RolloutBatch(taken, self.version).staleness_metrics())
        metrics.update({"rollout/groups_dropped_stale": self.dropped_stale, "rollout/buffer_depth": len(self.done),
                        "rollout/groups_in_flight": len(self.running), "rollout/groups_retried": self.retried,
                        "rollout/groups_failed": self.failed, "rollout/trajs_infra_failed": self.trajs_infra_failed,
                        "rollout/retries_refused": self.retries.refused, "rollout/groups_queued": len(self.queued),
                        "rollout/admission_window": self.window.limit})
        return metrics

    def train_while_rolling(self, training: list) -> None:
        """While the trainer works on `training` (refs to wait on), keep collecting finished
        groups and starting what admission allows."""
        pending = list(training)
        while pending:
            self.fill()
            ready = self._collect(also=pending)
            pending = [ref for ref in pending if ref not in ready]

    @property
    def version(self) -> int:
        """The policy version the servers hold (the trainer's): what new groups start on."""
        return self.policy_version()

    def trained(self) -> None:
        """The trainer finished its update and the servers hold its new version."""
        self.training = False

    def drain(self) -> list[RolloutGroup]:
        """Wait for every running group to finish -> everything finished and not trained."""
        self._pump()
        while self.running:
            self._collect()
        return sorted(self.done, key=lambda g: g.seq)

    def take_outcomes(self) -> dict:
        """What happened since the last call: keys drawn, trained, dropped by reason and failed with
        their cause (a ledger entry)."""
        out, self.outcomes = self.outcomes, _no_outcomes()
        return out

    # -- resume -------------------------------------------------------------------------------

    def unfinished(self) -> tuple[list[tuple[str, Any]], list[RolloutGroup]]:
        """((key, row) of every group still running or waiting to be redone, finished groups not yet trained)."""
        running = sorted([*self.running.values(), *self.queued], key=lambda r: r.seq)
        return [*self.redo, *[(r.key, r.row) for r in running]], sorted(self.done, key=lambda g: g.seq)

    def restore(self, redo: list[tuple[str, Any]], done: list[RolloutGroup]) -> None:
        """After a resume: groups to roll out again (same keys, so the same seeds) before new prompts
        are drawn, and finished groups to train first."""
        self.redo = list(redo)
        self.done = list(done)
        self.seq = max((g.seq for g in done), default=-1) + 1
