"""Faults during a real run (vLLM on the tiny model, the shared Ray cluster): a reward worker that
dies, a reward fn that raises, agent workers and a sandbox pool killed while groups are in flight,
the reward worker stopped (SIGSTOP: hung, found by the heartbeat), the LLM manager and the only
rollout server killed together as a step starts. The run goes on, the groups that were hit are rolled out
again, and the ledger gives every drawn group exactly one outcome."""

from __future__ import annotations

import json
import re
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_killed_and_hung_actors_of_every_light_kind_are_restarted_and_their_groups_rolled_out_again(ray_cluster, tmp_path):
    from actors.common import live_actors
    from actors.drivers.pipeline import run
    from raytool.ledger import audit

    faults = tmp_path / "faults"
    faults.mkdir()
    cfg = load_config(None, [
        "model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "trainer.sft_warmup_steps=0", "trainer.total_steps=3", "trainer.save_final=false",
        "rollout.engine=hf", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=48", "rollout.seed=7",
        f"cluster.namespace=raytool-light-faults-{os.getpid()}", "agent.num_workers=2", "reward.retries=1", "cluster.heartbeat_s=2", "rollout.max_group_retries=4", f"reward.fn={REPO / 'tests' / 'helpers' / 'faulty_reward.py'}:score",
        f"cluster.env_vars={{RAYTOOL_FAULT_DIR: {faults}}}", "logging.logger=[]", "logging.progress=false",
    ])
    killed: dict = {}

    def kill_while_a_group_is_scored():
        deadline = time.time() + 300
        while time.time() < deadline and not (faults / "holding").exists():
            time.sleep(0.05)
        kill("AgentLoopWorker", "SandboxPool")
        kill("RewardWorker", sig=signal.SIGSTOP)  # hung, not dead: the watchdog must find it
        metrics = tmp_path / "run" / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        kill("LLMManager", "RolloutServer")  # as step 3 starts rolling out; the only server, on weights v2

    def kill(*classes, sig=signal.SIGKILL):
        for cls in classes:
            for actor in live_actors(cfg.cluster.namespace, cls):
                os.kill(actor.pid, sig)
                killed.setdefault(cls, []).append(actor.pid)

    killer = threading.Thread(target=kill_while_a_group_is_scored, daemon=True)
    killer.start()
    run_dir = run(cfg, tmp_path / "run")
    killer.join(timeout=5)
    assert {cls: len(pids) for cls, pids in killed.items()} == {"AgentLoopWorker": 2, "SandboxPool": 1, "RolloutServer": 1, "RewardWorker": 1,
                                                                "LLMManager": 1}

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout/trajectories"] == 4 for m in steps)  # every group of every step came through
    # The killed agent workers lost the groups they were running: at least the one held in scoring
    # when they were killed. (Whether the other group was still running then, and whether the reward
    # fn's raise met a trajectory's last attempt, making it infra-failed, or one its retry then
    # scored, is the machine's timing: both were seen, in CI and here.)
    assert sum(m["rollout/groups_retried"] for m in steps) >= 1
    assert sum(m["ledger/failed"] for m in steps) == 0
    counts = audit(run_dir)
    assert counts["drawn"] == counts["trained"] == 6 and set(counts) == {"drawn", "trained"}
    log = (run_dir / "run.log").read_text()
    # The reward fn raised (its 2nd call) and the run went on. Whether that raise alone cost a group
    # depends on which trajectory's retry met the restarted worker first: its retry may score.
    assert "rolling it out again" in log and (faults / "call-2").exists() and (faults / "holding").exists()
    assert re.search(r"watchdog: reward-worker-0 \(pid \d+\) did not answer a heartbeat within cluster.heartbeat_s=2s", log)
    # The only server came back on its base weights; it was synced to v2 within step 3 (its requests waited for it).
    assert "rollout servers ['rollout-server-0'] were restarted (base weights): weight sync v2 to them" in log



def test_the_watchdog_kills_a_stopped_actor_and_stops_the_run_for_one_dead_for_good(ray_cluster):
    """A stopped (SIGSTOP) actor is killed within two heartbeats and Ray restarts it; an actor whose
    restarts are used up makes `check()` raise one line naming it and the key of its budget."""
    import os
    import signal
    import time

    import ray

    from actors.common import wait_until_alive
    from actors.drivers.watchdog import ActorLostError, Watchdog

    @ray.remote(num_cpus=0)
    class Pinger:
        def pid(self) -> int:
            return os.getpid()

    stoppable = Pinger.options(max_restarts=1).remote()
    mortal = Pinger.options(max_restarts=0).remote()
    watchdog = Watchdog({"agent-worker-0": stoppable, "rollout-server-0": mortal}, interval_s=1.0)
    first = ray.get(stoppable.pid.remote())
    ray.get(mortal.pid.remote())
    watchdog.check()  # all well: nothing to say
    os.kill(first, signal.SIGSTOP)
    ray.kill(mortal, no_restart=True)
    start = time.monotonic()
    while "agent-worker-0" not in watchdog.killed or "rollout-server-0" not in watchdog.lost:
        watchdog.beat()
        assert time.monotonic() - start < 30, (watchdog.killed, watchdog.lost)
    assert time.monotonic() - start < 2 * 1.0 + 5  # within two heartbeats (and the state API's answer)
    assert wait_until_alive(stoppable) and ray.get(stoppable.pid.remote(), timeout=60) != first  # restarted
    with pytest.raises(ActorLostError, match=r"rollout-server-0 is dead for good.*rollout\.max_restarts"):
        watchdog.check()


def test_a_dead_trainer_worker_is_re_formed_from_the_last_checkpoint_and_every_step_is_logged_once(ray_cluster, tmp_path, caplog):
    """The trainer worker SIGKILLed after the step-2 checkpoint, and its successor SIGSTOPped after
    the step-4 one (the driver's heartbeat finds it and kills it): each time the group is rebuilt
    and restored from the last checkpoint, and the run ends with steps 1..6 logged once each and
    the ledger reconciling. (One run for both faults: a run of its own for each cost a graph's
    start and four steps more.)
    The checkpoints go to trainer.checkpoint_dir as an fsspec URI (torch.distributed.checkpoint's
    fsspec writer and reader, the driver's files through fsspec)."""
    import logging

    from actors.common import live_actors
    from actors.drivers.pipeline import run
    from raytool.ledger import audit

    namespace = f"raytool-trainer-fault-{os.getpid()}"
    cfg = load_config(None, [
        "model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "rollout.engine=hf", "trainer.sft_warmup_steps=0", "trainer.total_steps=6", "trainer.save_every=2",
        "trainer.save_final=false", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16",
        "agent.max_response_tokens=48", "rollout.seed=7", "logging.logger=[]", "logging.progress=false", f"cluster.namespace={namespace}",
        f"trainer.checkpoint_dir=file://{tmp_path}/shared", "cluster.heartbeat_s=2",
    ])
    run_dir = tmp_path / "run"
    faults = []  # (signal, pid)

    def fault_after_the_checkpoint_of(step: int, sig: signal.Signals) -> bool:
        deadline = time.time() + 600
        metrics, saved = run_dir / "metrics.jsonl", tmp_path / "shared" / "run" / f"step_{step}" / "driver_state.json"
        while not (saved.exists() and metrics.exists() and len(metrics.read_text().splitlines()) > step):
            if time.time() > deadline:
                return False  # never past step + 1: the assertion on `faults` says so
            time.sleep(0.05)
        for actor in live_actors(namespace, "TrainerWorker"):
            if all(pid != actor.pid for _, pid in faults):  # the re-formed group's worker, not the one faulted before
                os.kill(actor.pid, sig)
                faults.append((sig, actor.pid))
        return True

    killer = threading.Thread(target=lambda: fault_after_the_checkpoint_of(2, signal.SIGKILL) and fault_after_the_checkpoint_of(4, signal.SIGSTOP),
                              daemon=True)
    killer.start()
    with caplog.at_level(logging.WARNING, logger="actors.drivers.pipeline"):
        run(cfg, run_dir)
    killer.join(timeout=5)
    assert [sig for sig, _ in faults] == [signal.SIGKILL, signal.SIGSTOP], f"the trainer workers were not both faulted: {faults}"
    lines = [r.getMessage() for r in caplog.records if "re-forming the trainer group" in r.getMessage()]
    assert len(lines) == 2, lines
    killed, stopped = lines
    assert re.search(r"trainer-0 died", killed) and "step_2" in killed and "failure 1 of trainer.max_failures=3" in killed, killed
    assert re.search(r"trainer-0 (did not answer a heartbeat within cluster\.heartbeat_s=2s|cannot be reached)", stopped), stopped
    assert "step_4" in stopped and "failure 2 of trainer.max_failures=3" in stopped, stopped
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert not (run_dir / "checkpoints").exists() and sorted(p.name for p in (tmp_path / "shared" / "run").iterdir()) == ["step_2", "step_4", "step_6"]
    assert (tmp_path / "shared" / "run" / "step_6" / "config.yaml").is_file()
    counts = audit(run_dir)
    assert counts["trained"] == 6 * 2 and counts["drawn"] == sum(v for k, v in counts.items() if k != "drawn")


def test_a_rollout_server_takes_a_second_attempt_at_a_version_and_refuses_an_older_one(ray_cluster):
    """The relay chain's re-send after a broken pass reaches a live server as attempt 2 of the same
    version and loads; a version older than the one it serves is refused in one line."""
    import ray
    import torch

    from actors.rollout_server import RolloutServer

    from raytool.engines import EngineOptions
    from raytool.models import resolve_model
    from raytool.weightsync import WeightSender

    server = RolloutServer.options(num_cpus=0).remote("rollout-server-t", resolve_model("tiny-random"), "scripted", EngineOptions(delay_s=0.0))
    (address,) = ray.get(server.ready.remote())
    sender = WeightSender([address], bucket_bytes=1 << 10, ipc=False)
    weights = {f"w{i}": torch.full((200,), float(i)) for i in range(3)}
    try:
        loading = server.receive_weights.remote(3, 10.0, 1)
        sender.send(weights.items(), 3, attempt=1)
        assert ray.get(loading).tensors == 3
        sender.send(weights.items(), 3, attempt=1)  # a duplicate of the first pass, queued at the server
        loading = server.receive_weights.remote(3, 10.0, 2)
        sender.send(weights.items(), 3, attempt=2)
        assert ray.get(loading).tensors == 3 and ray.get(server.health.remote()).policy_version == 3
        with pytest.raises(ray.exceptions.RayTaskError, match=r"weight sync v2 is older than the v3 it serves \(versions only go up\)"):
            ray.get(server.receive_weights.remote(2, 10.0))
    finally:
        sender.close()
        ray.kill(server)


def test_an_actor_that_dies_while_the_graph_starts_is_waited_for_and_asked_again(ray_cluster, tmp_path):
    """A light actor or rollout server killed while the run starts (a fault during the graph build,
    or during a re-formation's rebuild) is restarted by Ray; the build waits for it instead of failing.
    (One stopped then is found by the build's watchdog, `build(watch=True)`, and killed like this.)"""
    import ray

    from actors.drivers.compose import wait_started
    from raytool.errors import ActorStartError

    @ray.remote(num_cpus=0)
    class DiesOnce:
        def __init__(self, marker: str):
            self.marker = marker

        async def ready(self) -> int:
            if not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-start, once
            return os.getpid()

    actor = DiesOnce.options(max_restarts=1).remote(str(tmp_path / "died"))
    assert wait_started({"sandbox-pool-0": (actor, actor.ready)})["sandbox-pool-0"] > 0
    mortal = DiesOnce.options(max_restarts=0).remote(str(tmp_path / "dies-for-good"))
    with pytest.raises(ActorStartError, match="^reward-worker-0 failed to start"):
        wait_started({"reward-worker-0": (mortal, mortal.ready)})


def test_a_killed_sft_trainer_is_re_formed_from_its_last_checkpoint(ray_cluster, tmp_path, caplog):
    """`raytool sft` re-forms its trainer group like a training run: the rank killed right after the
    step-2 checkpoint, the run goes on from it and logs every step once."""
    import logging

    from actors.common import live_actors
    from actors.drivers.sft import run_sft

    namespace = f"raytool-sft-fault-{os.getpid()}"
    data = str(Path(__file__).resolve().parents[1] / "fixtures" / "sft_conversations.jsonl")
    cfg = load_config(None, ["model.path=tiny-random", f"sft.train_files=[{data}]", "sft.epochs=5", "sft.batch_size=2", "sft.save_every=2",
                             "sft.val_fraction=0", "logging.logger=[]", f"cluster.namespace={namespace}"])
    run_dir = tmp_path / "sft"
    killed = []

    def kill_after_the_step_2_checkpoint():
        deadline = time.time() + 300
        pids = []
        while not pids and time.time() < deadline:
            pids = [a.pid for a in live_actors(namespace, "TrainerWorker")]
        while time.time() < deadline and not (run_dir / "checkpoints" / "step_2" / "driver_state.json").exists():
            time.sleep(0.01)
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    killer = threading.Thread(target=kill_after_the_step_2_checkpoint, daemon=True)
    killer.start()
    with caplog.at_level(logging.WARNING, logger="actors.drivers.pipeline"):
        run_sft(cfg, run_dir)
    killer.join(timeout=5)
    assert killed
    lines = [r.getMessage() for r in caplog.records if "re-forming the trainer group" in r.getMessage()]
    assert len(lines) == 1 and "trainer-0 died" in lines[0] and "checkpoints/step_" in lines[0], lines
    steps = [json.loads(line)["step"] for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


def test_validation_rolls_out_again_a_group_whose_agent_worker_died(ray_cluster, tmp_path):
    """Graph.rollout (validation, `raytool eval`) retries a group whose agent worker died, as the
    training stream does, on the restarted worker with the same group key; a worker that dies on
    every attempt is one line naming the group."""
    import ray

    from actors.drivers.compose import Graph
    from raytool.data.prompts import PromptRow
    from raytool.errors import RaytoolError

    @ray.remote(max_restarts=1)
    class DiesFirst:
        def __init__(self, marker: str, always: bool):
            self.marker, self.always = marker, always

        @ray.method(num_returns=3)
        def run_group(self, messages, ground_truth, group_id, n, agent_name, extra, sampling, attempt, teach=True):
            if self.always or not os.path.exists(self.marker):
                Path(self.marker).touch()
                os._exit(1)
            from raytool.streaming import TrajectoryStats

            stat = TrajectoryStats(1.0, 1.0, 1, 1, 1, 0, 0, {}, 0, 0, f"attempt-{attempt}", 0.0, "", 0, 0, {})
            return [group_id] * n, [stat] * n, []

    row = PromptRow(prompt=[{"role": "user", "content": "1+1?"}], ground_truth="2", data_source="t")
    cfg = load_config(None, ["rollout.max_group_retries=1"])
    graph = Graph(cfg, "", {}, None, [], [], [DiesFirst.remote(str(tmp_path / "died"), False)], None)
    stats, refs = graph.rollout([row], "val", n=2)
    assert [x.finish_reason for x in stats] == ["attempt-1", "attempt-1"] and ray.get(refs[0].trajectories) == ["val0", "val0"]
    graph = Graph(cfg, "", {}, None, [], [], [DiesFirst.remote(str(tmp_path / "always"), True)], None)
    with pytest.raises(RaytoolError, match=r"group val0 failed 2 times \(rollout.max_group_retries=1\): agent worker: "):
        graph.rollout([row], "val", n=2)


def test_a_trainer_that_fails_to_start_beside_the_engines_is_named_and_nothing_of_the_run_is_left(ray_cluster):
    """The trainer loads its model while the engines start: its failure there is one line naming the
    trainer and its cause, raised once the others are up, and every actor of the run is gone."""
    from actors.common import actors_left
    from actors.drivers.compose import build
    from raytool.errors import ActorStartError

    namespace = f"raytool-trainer-start-{os.getpid()}"
    cfg = load_config(None, ["model.path=tiny-random", "rollout.engine=hf", "trainer.lora_rank=4", "trainer.lora_target_modules=[no_such_proj]",
                             "logging.logger=[]", f"cluster.namespace={namespace}"])
    with pytest.raises(ActorStartError, match="^trainer failed to start: .*no_such_proj"):
        build(cfg)
    assert actors_left(namespace) == []


def test_a_trainer_that_cannot_be_placed_while_the_engines_start_leaves_nothing_of_the_run(ray_cluster):
    """The cluster could hold the run, but another job holds the CPUs the trainer needs: its
    placement group's wait ends in one line naming the config keys, and the actors already started
    for the run are gone."""
    import ray

    from actors.common import actors_left
    from actors.drivers.compose import build
    from raytool.placement import PlacementError

    @ray.remote(num_cpus=1.5)
    class Squatter:
        def ready(self) -> bool:
            return True

    squatter = Squatter.remote()
    ray.get(squatter.ready.remote())
    namespace = f"raytool-trainer-unplaced-{os.getpid()}"
    cfg = load_config(None, ["model.path=tiny-random", "rollout.engine=hf", "rollout.num_cpus=0.1", "cluster.light_actor_cpus=0.05", "trainer.num_cpus=1",
                             "cluster.placement_timeout_s=3", "logging.logger=[]", f"cluster.namespace={namespace}"])
    try:
        with pytest.raises(PlacementError, match=r"the trainer's placement group .* was not placed within 3s .*trainer\.num_cpus"):
            build(cfg)
    finally:
        ray.kill(squatter)
    assert actors_left(namespace) == []
