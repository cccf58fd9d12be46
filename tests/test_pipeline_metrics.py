"""The streaming rollout core (raytool.streaming) on scripted rollouts: no Ray, milliseconds."""

from raytool.data import PromptLoader
import msgspec

from raytool.streaming import GroupFailed, RolloutStream, TrajectoryStats, rollout_metrics


def _stat(**fields) -> TrajectoryStats:
    base = dict(reward=0.0, acc=0.0, response_length=10, generated_tokens=10, num_turns=1, tool_calls=0, tool_errors=0, tool_error_kinds={},
                tool_repaired=0, tool_cut_in_fence=0, finish_reason="answer", verify_timeout=0.0, infra_failure="", min_version=0, max_version=0,
                version_counts={})
    return TrajectoryStats(**{**base, **fields})


def test_rollout_metrics_from_trajectory_stats():
    stats = [
        _stat(reward=1.0, acc=1.0, response_length=40, generated_tokens=30, num_turns=2, tool_calls=1, tool_errors=0, finish_reason="answer"),
        _stat(reward=0.0, acc=0.0, response_length=80, generated_tokens=50, num_turns=3, tool_calls=3, tool_errors=2, finish_reason="max_turns"),
    ]
    m = rollout_metrics(stats)
    assert m["reward/mean"] == 0.5 and m["response_length/mean"] == 60 and m["num_turns/mean"] == 2.5
    assert m["tool/calls_per_traj"] == 2.0 and m["tool/error_rate"] == 0.5
    assert m["finish/answer"] == 0.5 and m["finish/max_turns"] == 0.5
    assert rollout_metrics([msgspec.structs.replace(stats[0], tool_calls=0)])["tool/error_rate"] == 0.0


def test_a_time_limited_trajectory_is_neither_a_wrong_answer_in_the_metrics_nor_a_difference_for_dynamic_sampling():
    """Stopped by agent.max_trajectory_s, it is not scored: the means are over the scored ones, the
    finish rate counts it, and a group whose scored samples agree is all-equal to DAPO's filter
    (the update leaves the time-limited one out, so nothing would be learned from the group)."""
    from raytool.streaming import RolloutGroup
    from raytool.types import TIME_LIMIT

    stats = [_stat(reward=1.0, acc=1.0), _stat(reward=1.0, acc=1.0), _stat(reward=0.0, finish_reason=TIME_LIMIT)]
    m = rollout_metrics(stats)
    assert m["reward/mean"] == 1.0 and m["acc/mean"] == 1.0 and m[f"finish/{TIME_LIMIT}"] == 1 / 3
    group = RolloutGroup(key="g", seq=0, row=None, ref=None, stats=stats, submitted_version=0)
    assert not group.rewards_vary()
    assert RolloutGroup(key="h", seq=1, row=None, ref=None, stats=[*stats, _stat(reward=0.0)], submitted_version=0).rewards_vary()


class _Rollouts:
    """Scripted agent workers: `rewards(key)` gives a group's sample rewards; a group's tokens carry
    the version the trainer held when it started, unless `late` moves them on. `wait` finishes
    groups `per_wait` at a time in submission order (None: all), and reports the trainer's refs done
    once nothing runs or `train_done` is True (None: together with the next groups that finish)."""

    def __init__(self, rewards=lambda key: [1.0, 0.0], per_wait=None, failures=None):
        self.rewards, self.per_wait = rewards, per_wait
        self.failures = failures or {}  # key -> per attempt: "" (fine), "worker" (its agent worker died) or an infra cause
        self.started: list[str] = []
        self.attempts: list[tuple[str, int]] = []
        self.version = 0
        self.train_done = False
        self.stream: RolloutStream | None = None

    def policy_version(self) -> int:  # the control plane's, in a run
        return self.version

    def trained(self, version: int) -> None:
        """The trainer's update is synced to the servers as `version`."""
        self.version = version
        self.stream.trained()

    def submit(self, row, key, attempt=0):
        self.started.append(key)
        self.attempts.append((key, attempt))
        return f"traj-{key}", (f"stats-{key}", key, self.stream.version, attempt)

    def wait(self, stats_refs, also):
        if also and (self.train_done or not stats_refs):
            return {}, list(also)
        chosen = stats_refs if self.per_wait is None else stats_refs[: self.per_wait]
        return self._finish(chosen), list(also) if self.train_done is None else []

    def _finish(self, chosen):
        out = {}
        for ref in chosen:
            script = self.failures.get(ref[1], [])
            cause = script[ref[3]] if ref[3] < len(script) else ""
            if cause == "worker":
                out[ref] = GroupFailed("RayActorError: the actor died unexpectedly")
                continue
            out[ref] = [_stat(reward=r, acc=r, min_version=ref[2], max_version=ref[2], version_counts={ref[2]: 10}, infra_failure=cause if i == 0 else "")
                        for i, r in enumerate(self.rewards(ref[1]))]
        return out


def _stream(rollouts: _Rollouts, k: int, dynamic: bool = False, rounds: int = 1, per_step: int = 2, retries: int = 2) -> RolloutStream:
    loader = PromptLoader([f"p{i}" for i in range(100)], per_step, seed=0)
    rollouts.stream = RolloutStream(per_step, k, loader.next_batch, rollouts.submit, rollouts.wait, policy_version=rollouts.policy_version, dynamic_sampling=dynamic, max_rounds=rounds,
                                    max_retries=retries)
    return rollouts.stream


def test_synchronous_stream_rolls_out_one_batch_per_step_and_nothing_while_training():
    r = _Rollouts()
    stream = _stream(r, k=0)
    batch, metrics = stream.next_batch(1)
    assert [g.key for g in batch.groups] == ["s1r1g0", "s1r1g1"] and r.started == ["s1r1g0", "s1r1g1"]
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0] and batch.group_index == [0, 0, 1, 1] and batch.offsets == [0, 2]
    stream.train_while_rolling(["train-ref"])
    assert r.started == ["s1r1g0", "s1r1g1"]  # nothing starts on the old weights
    r.trained(1)
    batch, metrics = stream.next_batch(2)
    assert [g.key for g in batch.groups] == ["s2r1g0", "s2r1g1"] and batch.version == 1
    assert metrics["staleness/token_max"] == 0 and metrics["rollout/groups_dropped_stale"] == 0
    assert "rollout/sampling_rounds" not in metrics


def test_dynamic_sampling_keeps_groups_with_a_reward_spread_until_the_batch_is_full():
    script = {"s5r1g0": [1.0, 1.0], "s5r1g1": [0.0, 1.0], "s5r2g0": [0.0, 0.0], "s5r2g1": [1.0, 0.0]}
    stream = _stream(_Rollouts(lambda key: script[key]), k=0, dynamic=True, rounds=3)
    batch, metrics = stream.next_batch(5)
    assert [g.key for g in batch.groups] == ["s5r1g1", "s5r2g1"]  # the all-equal groups are dropped
    assert [s.group for s in batch.stats()] == [0, 0, 1, 1] and batch.rewards == [0.0, 1.0, 1.0, 0.0]
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/prompts_drawn"] == 4 and metrics["rollout/groups_kept"] == 2
    assert metrics["reward/mean"] == 0.5  # over everything rolled out, before the filter


def test_dynamic_sampling_stops_at_the_round_cap_and_trains_on_the_last_round():
    stream = _stream(_Rollouts(lambda key: [0.0, 0.0]), k=0, dynamic=True, rounds=2)
    batch, metrics = stream.next_batch(1)
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/groups_kept"] == 0
    assert [g.key for g in batch.groups] == ["s1r2g0", "s1r2g1"]  # nothing to learn from: the last round (advantages all zero)


def test_asynchronous_admission_keeps_at_most_max_staleness_plus_one_steps_ahead():
    r = _Rollouts(per_wait=1)
    stream = _stream(r, k=1)
    batch, _ = stream.next_batch(1)
    assert r.started == ["s1r1g0", "s1r1g1", "s1r2g0", "s1r2g1"]  # two steps' worth at version 0
    assert [g.key for g in batch.groups] == ["s1r1g0", "s1r1g1"]
    stream.train_while_rolling(["train-ref"])  # the batch in training still counts: nothing new starts on version 0
    assert len(r.started) == 4
    r.trained(1)
    batch, metrics = stream.next_batch(2)
    assert [g.key for g in batch.groups] == ["s1r2g0", "s1r2g1"] and batch.version == 1
    assert r.started[4:] == ["s2r1g0", "s2r1g1"]  # started on version 1, for step 3
    assert metrics["staleness/token_mean"] == 1 and metrics["staleness/traj_max"] == 1


def test_a_group_older_than_the_bound_is_dropped_and_counted():
    r = _Rollouts(per_wait=None)
    stream = _stream(r, k=1)
    stream.next_batch(1)  # takes wave 1; wave 2 (version 0) waits in the buffer
    r.trained(1)
    r.trained(2)  # two updates later wave 2 lags by 2 > max_staleness
    batch, metrics = stream.next_batch(3)
    assert metrics["rollout/groups_dropped_stale"] == 2
    assert all(g.min_version == 2 for g in batch.groups) and metrics["staleness/traj_max"] == 0


def test_unfinished_groups_are_redone_first_with_their_keys():
    r = _Rollouts(per_wait=1)
    stream = _stream(r, k=1)
    stream.next_batch(1)
    r.train_done = None  # the update ends after one more group finished
    stream.train_while_rolling(["train-ref"])
    redo, waiting = stream.unfinished()
    assert [key for key, _ in redo] == ["s1r2g1"] and [g.key for g in waiting] == ["s1r2g0"]
    r2 = _Rollouts()
    resumed = _stream(r2, k=1)
    resumed.restore(redo, waiting)
    batch, _ = resumed.next_batch(2)
    assert r2.started[0] == "s1r2g1"  # rolled out again before any new prompt is drawn
    assert [g.key for g in batch.groups] == ["s1r2g0", "s1r2g1"]


def test_the_ledger_gives_every_drawn_group_exactly_one_outcome_across_a_resume(tmp_path):
    import pytest

    from raytool.ledger import Ledger, LedgerError, audit

    script = {"s1r1g0": [1.0, 1.0], "s1r1g1": [0.0, 1.0], "s1r2g0": [1.0, 0.0], "s1r2g1": [0.0, 1.0]}
    r = _Rollouts(lambda key: script.get(key, [1.0, 0.0]))
    stream = _stream(r, k=0, dynamic=True, rounds=3)
    ledger = Ledger(tmp_path)
    stream.next_batch(1)
    r.trained(1)
    ledger.record(1, **stream.take_outcomes())  # one surplus group waits in the buffer
    stream.next_batch(2)
    r.trained(2)
    ledger.record(2, **stream.take_outcomes())
    ledger.record(3, drawn=["s3r1g0"], trained=["s3r1g0"], dropped={})  # a step the driver did before it died
    resumed = Ledger(tmp_path, resume_step=2)  # cuts step 3: it is done again
    redo, waiting = stream.unfinished()
    resumed.finish(2, [key for key, _ in redo] + [g.key for g in waiting])
    counts = audit(tmp_path)
    assert counts == {"drawn": 6, "trained": 4, "dropped:zero_variance": 1, "dropped:stale": 1}
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    (tmp_path / "ledger.jsonl").write_text("\n".join([*lines, lines[0]]) + "\n")
    with pytest.raises(LedgerError, match="s1r1g1 is both trained and trained"):
        audit(tmp_path)


def test_a_group_an_infrastructure_failure_hit_is_rolled_out_again_with_its_key():
    """A sandbox failure in one sample, then a dead agent worker: the group is submitted again under
    its key (so the same seeds) and trained from its third rollout; nothing else is drawn."""
    r = _Rollouts(failures={"s1r1g1": ["sandbox: pool is full", "worker", ""]})
    stream = _stream(r, k=0)
    batch, metrics = stream.next_batch(1)
    assert [g.key for g in batch.groups] == ["s1r1g0", "s1r1g1"]
    assert r.attempts == [("s1r1g0", 0), ("s1r1g1", 0), ("s1r1g1", 1), ("s1r1g1", 2)]
    assert metrics["rollout/groups_retried"] == 2 and metrics["rollout/groups_failed"] == 0 and metrics["rollout/trajs_infra_failed"] == 1
    assert metrics["reward/mean"] == 0.5  # the failed rollouts are in no metric of the policy
    assert stream.take_outcomes() == {"drawn": ["s1r1g0", "s1r1g1"], "trained": ["s1r1g0", "s1r1g1"], "dropped": {}, "failed": {}}


def test_a_group_that_keeps_failing_is_left_out_of_the_loss_and_recorded_with_its_cause(tmp_path):
    from raytool.ledger import Ledger, audit, outcome_metrics

    r = _Rollouts(failures={"s1r1g0": ["reward: RewardError: boom"] * 3})
    stream = _stream(r, k=0, retries=2)
    batch, metrics = stream.next_batch(1)
    assert [g.key for g in batch.groups] == ["s1r1g1"]  # the step trains on what it has: no replacement wave
    assert r.started == ["s1r1g0", "s1r1g1", "s1r1g0", "s1r1g0"]
    assert metrics["rollout/groups_failed"] == 1 and metrics["rollout/groups_retried"] == 2
    outcomes = stream.take_outcomes()
    assert outcomes["failed"] == {"s1r1g0": "reward: RewardError: boom"}
    assert outcome_metrics(outcomes) == {"ledger/drawn": 2, "ledger/trained": 1, "ledger/dropped": 0, "ledger/failed": 1}
    Ledger(tmp_path).record(1, **outcomes)
    assert audit(tmp_path) == {"drawn": 2, "trained": 1, "failed": 1}
    r.trained(1)
    batch, _ = stream.next_batch(2)  # the next step is full again
    assert [g.key for g in batch.groups] == ["s2r1g0", "s2r1g1"]


def test_groups_that_all_fail_stop_the_run_with_the_cause_instead_of_rolling_out_forever():
    import pytest

    from raytool.errors import RaytoolError

    r = _Rollouts(failures={f"s1r{w}g{g}": ["worker", "worker"] for w in range(1, 5) for g in range(2)})
    stream = _stream(r, k=0, retries=1)
    with pytest.raises(RaytoolError, match=r"4 prompt groups in a row failed .*rollout.max_group_retries=1.*agent worker: RayActorError"):
        stream.next_batch(1)
    assert len(r.started) == 8  # two waves, each group tried twice


def test_groups_that_keep_coming_back_stale_stop_the_run_instead_of_drawing_waves_forever():
    """Servers that never got the weight syncs (every group generated on v0 while the trainer is on v3):
    each wave is dropped as stale, and after a few batches' worth the run stops saying why."""
    import pytest

    from raytool.errors import RaytoolError

    r = _Rollouts()
    stream = _stream(r, k=0)
    r.trained(3)
    stream.submit = lambda row, key, attempt=0: (r.started.append(key), (f"traj-{key}", (f"stats-{key}", key, 0, attempt)))[1]
    with pytest.raises(RaytoolError, match=r"step 1: 8 groups came back stale, .*max_staleness=0 .*v3 \(the newest: v0\)"):
        stream.next_batch(1)
    assert len(r.started) == 8


def test_one_retry_policy_for_groups_retries_infrastructure_failures_then_calls_them_failed():
    from raytool.streaming import GroupRetries

    policy = GroupRetries(max_retries=2)
    fine = [_stat(reward=1.0), _stat(reward=0.0)]
    sandbox = [_stat(infra_failure="sandbox: pool died"), _stat()]
    died = GroupFailed("RayActorError: the actor died unexpectedly")
    assert policy.verdict(0, fine) == ("ok", "")
    assert policy.verdict(0, sandbox) == ("retry", "sandbox: pool died") and policy.verdict(1, sandbox)[0] == "retry"
    assert policy.verdict(2, sandbox) == ("failed", "sandbox: pool died")
    assert policy.verdict(2, died) == ("failed", "agent worker: RayActorError: the actor died unexpectedly")
    assert GroupRetries(max_retries=0).verdict(0, died)[0] == "failed"


def test_a_stage_that_holds_groups_up_shrinks_the_groups_in_flight_and_loses_none():
    """Back-pressure (raytool.overload): every group's scoring queued ten times longer than it
    scored, so the admission window halves while the first step's wave drains, and the next step's
    groups start a few at a time; each step still trains on all its groups, none rolled out again,
    and the stage's queue and service time are in the step's metrics."""
    from raytool.overload import AdmissionWindow

    class Slow(_Rollouts):
        in_flight: list[int] = []

        def _finish(self, chosen):
            self.in_flight.append(len(self.stream.running))
            out = super()._finish(chosen)
            return {ref: [msgspec.structs.replace(s, stages={"reward": (5.0, 0.5)}) for s in stats] for ref, stats in out.items()}

    r = Slow(per_wait=1)
    loader = PromptLoader([f"p{i}" for i in range(100)], 8, seed=0)
    r.stream = stream = RolloutStream(8, 0, loader.next_batch, r.submit, r.wait, policy_version=r.policy_version, window=AdmissionWindow(8))
    batch, metrics = stream.next_batch(1)
    assert len(batch.groups) == 8 and metrics["rollout/groups_retried"] == 0 and metrics["rollout/groups_failed"] == 0
    assert r.in_flight == [8, 7, 6, 5, 4, 3, 2, 1]  # the wave had started whole: it drains
    assert stream.window.limit == 1 and stream.window.bottleneck == "reward" and metrics["rollout/admission_window"] == 1
    assert metrics["stage/reward/queue_s"] == 5.0 and metrics["stage/reward/service_s"] == 0.5
    r.trained(1)
    r.in_flight.clear()
    batch, metrics = stream.next_batch(2)
    assert len(batch.groups) == 8 and r.in_flight == [1] * 8 and metrics["rollout/groups_retried"] == 0  # one at a time now
    assert [k for k, _ in r.attempts] == [f"s{s}r1g{i}" for s in (1, 2) for i in range(8)]  # each started once, in order


def test_retries_past_the_steps_budget_fail_the_group_instead_of_adding_load():
    """Eight groups whose scoring fails: the budget (rollout.retry_budget x groups started, at least
    4) lets 4 roll out again; the others are failed at once, with the budget in their cause."""
    r = _Rollouts(failures={f"s1r1g{i}": ["reward: RewardError: judge overloaded", ""] for i in range(8)})
    loader = PromptLoader([f"p{i}" for i in range(100)], 8, seed=0)
    r.stream = stream = RolloutStream(8, 0, loader.next_batch, r.submit, r.wait, policy_version=r.policy_version, max_retries=2, retry_budget=0.25)
    batch, metrics = stream.next_batch(1)
    assert metrics["rollout/groups_retried"] == 4 and metrics["rollout/retries_refused"] == 4 and metrics["rollout/groups_failed"] == 4
    assert len(batch.groups) == 4 and len(r.started) == 12
    failed = stream.take_outcomes()["failed"]
    assert len(failed) == 4 and all("retry budget, rollout.retry_budget=0.25, is spent" in c for c in failed.values())
    r.trained(1)
    _, metrics = stream.next_batch(2)  # a new step, a new budget
    assert metrics["rollout/retries_refused"] == 0


def test_a_stage_that_keeps_failing_stops_the_run_naming_it_and_its_error_rate():
    import pytest

    from raytool.errors import RaytoolError

    r = _Rollouts(failures={f"s1r{w}g{g}": ["sandbox: backend down"] * 2 for w in range(1, 5) for g in range(2)})
    stream = _stream(r, k=0, retries=1)
    with pytest.raises(RaytoolError, match=r"the sandbox stage failed 8 of 8 rollouts that came back in this step; the last: sandbox: backend down"):
        stream.next_batch(1)
