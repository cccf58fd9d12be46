"""The whole actor graph on one shared Ray cluster: a tiny training run, the README's composition
example, and the same run submitted as a Ray job."""

from __future__ import annotations

import json
import re
import subprocess
import shutil
from pathlib import Path

import pytest

from raytool.config import load_config
from raytool.errors import RaytoolError

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

REQUIRED_KEYS = {
    "step", "critic/score/mean", "critic/rewards/mean", "acc/mean", "response_length/mean", "num_turns/mean", "tool/calls_per_traj",
    "tool/error_rate", "timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "policy_version",
}
TINY = ["model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "trainer.total_steps=2", "trainer.sft_warmup_steps=2", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.max_tokens_per_turn=24", "agent.max_response_tokens=64"]


def test_tiny_run_checkpoints_and_a_resumed_run_repeats_step_three_exactly(ray_cluster, tmp_path, logprob_tolerance):
    """A 3-step run that checkpoints at step 2, and a run resumed from that checkpoint: step 3
    draws the same prompts, samples the same tokens (seeded), trains to the same metrics and ends
    on bit-identical weights."""
    import torch
    from safetensors.torch import load_file

    from actors.drivers.pipeline import run

    # An entropy bonus trains every sequence (no zero-advantage skipping: the random model earns
    # no reward), so the engine/trainer log-prob mismatch is measured on all of them.
    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml",
                      TINY + ["trainer.total_steps=3", "trainer.save_every=2", "rollout.seed=7", "algorithm.entropy_coeff=0.001", "agent.gateway=true"])
    run_dir = run(cfg, tmp_path / "run")
    # agent.gateway: an OpenAI-compatible gateway served beside the run, its URL in the run directory
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", json.loads((run_dir / "gateway.json").read_text())["url"])
    grpo = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sft = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in sft] == [1, 2] and all(m["train/loss"] > 0 for m in sft)
    assert [m["step"] for m in grpo] == [1, 2, 3]
    for m in grpo:
        assert REQUIRED_KEYS <= m.keys()
        assert m["timing_s/update_weights"] > 0 and m["response_length/mean"] > 0
        # After each sync the engine serves the trainer's weights: its log-probs of the sampled
        # tokens equal the trainer's (tolerance per token by the default dtypes here: fp32 1e-3, bf16 1e-2).
        assert m["rollout/logprob_abs_diff"] < logprob_tolerance
    # SFT warm-up synced version 1; each GRPO step one more.
    assert [m["policy_version"] for m in grpo] == [2, 3, 4]
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert traces and all(len(t["response_ids"]) == len(t["response_mask"]) for t in traces)
    assert {d.name for d in (run_dir / "checkpoints").iterdir()} == {"step_2", "step_3"}
    exported = run_dir / "checkpoints" / "step_3" / "hf"
    assert "model.layers.0.mlp.up_proj.weight" in load_file(exported / "model.safetensors")
    assert "tiny-random" in (run_dir / "config.yaml").read_text()

    resumed_dir = run(cfg, tmp_path / "resumed", resume=run_dir / "checkpoints" / "step_2")
    (again,) = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert again["step"] == 3 and again["policy_version"] == 4
    step3 = [t for t in traces if t["step"] == 3]
    resumed_traces = [json.loads(line) for line in (resumed_dir / "traces.jsonl").read_text().splitlines()]
    assert [t["prompt_text"] for t in resumed_traces] == [t["prompt_text"] for t in step3]
    assert [t["response_ids"] for t in resumed_traces] == [t["response_ids"] for t in step3]
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert again[key] == pytest.approx(grpo[2][key], rel=1e-4, abs=1e-6), key
    # ... and ends on the very same weights, bit for bit.
    original, resumed = load_file(exported / "model.safetensors"), load_file(resumed_dir / "checkpoints" / "step_3" / "hf" / "model.safetensors")
    assert original.keys() == resumed.keys()
    assert [name for name in original if not torch.equal(original[name], resumed[name])] == []


def test_readme_composition_example_runs(ray_cluster):
    readme = (REPO / "docs" / "compose.md").read_text()
    block = re.search(r"<!-- compose-example -->\s*```python\n(.*?)```", readme, re.DOTALL)
    assert block, "docs/compose.md lost its composition example"
    namespace: dict = {}
    exec(compile(block.group(1), "README.md:compose-example", "exec"), namespace)
    stats = namespace["stats"]
    assert len(stats) == 2 * 2 and all(s.response_length > 0 for s in stats)


def test_weight_sync_fan_out_and_a_killed_server_restarted_resynced_and_readmitted(ray_cluster):
    """Two vLLM servers, one run: one loses its vLLM engine core (the actor lives on with a dead
    engine: it exits at its next call so that Ray restarts it). The next sync leaves the victim out
    at once, every request still gets an answer, and the restarted server is resynced and
    re-admitted. (A server whose actor process dies takes the same path from Ray's restart on: the
    HF-engine tests below kill servers' processes, here only the engine core is vLLM's own.)"""
    import time

    import psutil
    import ray

    from actors.drivers.compose import build
    from raytool.types import SamplingParams

    cfg = load_config(None, TINY + ["rollout.num_servers=2", "rollout.num_cpus=0.5", "trainer.num_cpus=0.5",
                                    "rollout.health_probe_interval_s=1"])
    graph = build(cfg)
    names = ["rollout-server-0", "rollout-server-1"]

    def burst(tag: str, n: int = 4):
        return ray.get([graph.manager.generate.remote([1, 2, 3], SamplingParams(max_tokens=4), f"{tag}{i}", f"{tag}s{i}")
                        for i in range(n)], timeout=120)

    def kill_resync_readmit(victim: str, version: int) -> None:
        pid = ray.get(graph.servers[victim].health.remote()).pid
        for child in psutil.Process(pid).children(recursive=True):  # the engine core, not the actor
            child.kill()
        psutil.wait_procs(psutil.Process(pid).children(recursive=True), timeout=10)
        # Right after a step: the next sync leaves it out at once (no wait for Ray's restart), the
        # manager ejects it, and every request still gets an answer.
        (survivor,) = [n for n in names if n != victim]
        start = time.time()
        result = graph.sync_weights(version=version)
        assert [a.server for a in result.acks] == [survivor] and set(result.failed) == {victim}
        assert time.time() - start < 30
        outs = burst(f"r{version}")
        assert all(o.server == survivor and len(o.token_ids) == 4 for o in outs)
        stats = ray.get(graph.manager.stats.remote())
        assert victim in stats.ejected and ray.get(graph.manager.central_stats.remote())["in_flight"] == {n: 0 for n in names}
        # Ray restarts it with a fresh engine on the base weights: the probe finds it behind ...
        deadline = time.time() + 180
        while ray.get(graph.manager.stats.remote()).stale != [victim]:
            assert time.time() < deadline, "the restarted server never came back"
            time.sleep(1)
        assert ray.get(graph.servers[victim].health.remote()).policy_version == 0
        # ... the next weight sync reaches it at its new receiver, and it is re-admitted.
        result = graph.sync_weights(version=version + 1)
        assert {a.server for a in result.acks} == set(names) and not result.failed
        stats = ray.get(graph.manager.stats.remote())
        assert stats.ejected == {} and stats.stale == [] and stats.policy_version == version + 1
        outs = burst(f"after{version}", 8)
        assert {o.server for o in outs} == set(names) and {o.policy_version for o in outs} == {version + 1}

    try:
        result = graph.sync_weights(version=9)
        assert {a.server for a in result.acks} == set(names)
        assert all(a.tensors > 0 and a.version == 9 for a in result.acks)
        health = ray.get([s.health.remote() for s in graph.servers.values()])
        assert {h.policy_version for h in health} == {9}
        kill_resync_readmit("rollout-server-1", version=10)
    finally:
        graph.shutdown()


def test_train_as_a_ray_job(ray_cluster, tmp_path):
    ray_cli = shutil.which("ray", path=ray_cluster.env["PATH"])
    run_dir = tmp_path / "job-run"
    submission = f"raytool-test-{tmp_path.name}"
    cmd = [
        ray_cli, "job", "submit", "--address", ray_cluster.dashboard, "--submission-id", submission,
        "--runtime-env", "cluster_configs/runtime_env.yaml", "--",
        "raytool", "train", "-c", "examples/tiny_cpu.yaml", *TINY, "rollout.engine=hf", "trainer.total_steps=1", "--run-dir", str(run_dir),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=ray_cluster.env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert JobSubmissionClient(ray_cluster.dashboard).get_job_status(submission) == JobStatus.SUCCEEDED
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert len((run_dir / "sft_metrics.jsonl").read_text().splitlines()) == 2


def test_fsdp2_trainer_group_of_two_trains_syncs_and_saves(ray_cluster, tmp_path):
    import ray
    import torch
    from safetensors.torch import load_file

    from actors.drivers.compose import build
    from raytool.streaming import GroupRefs, RolloutBatch, RolloutGroup, TrajectoryStats
    from raytool.types import TrainSequence, Trajectory

    # micro_batch_tokens=6 with 3 trajectories: rank 0 runs two micro-batches, rank 1 one (plus a dummy).
    cfg = load_config(None, TINY + ["rollout.engine=hf", "trainer.num_workers=2", "trainer.num_cpus=0.5", "rollout.num_cpus=0.5",
                                    "trainer.lr=1e-2", "trainer.micro_batch_tokens=6"])
    graph = build(cfg)
    try:
        def traj(uid, resp, reward):
            return Trajectory(uid=uid, group_id="g", prompt_ids=[1, 2, 3], response_ids=resp, response_mask=[1] * len(resp),
                              rollout_logprobs=[0.0] * len(resp), messages=[], ground_truth="", reward=reward)

        trajectories = [traj("a", [5, 6, 7], 1.0), traj("b", [8, 9], 0.0), traj("c", [5, 6], 1.0)]
        ref = GroupRefs(ray.put(trajectories), ray.put([TrainSequence.of(t) for t in trajectories]))
        stats = [TrajectoryStats(r, r, n, n, 1, 0, 0, {}, 0, 0, "answer", 0.0, "", 0, 0, {0: n}) for r, n in ((1.0, 3), (0.0, 2), (1.0, 2))]
        metrics = graph.trainer.rl_step(RolloutBatch([RolloutGroup("g", 0, None, ref, stats, 0)], version=0))
        assert metrics["actor/grad_norm"] > 0
        acks = graph.sync_weights(version=4).acks
        assert acks[0].tensors > 0
        graph.trainer.save_checkpoint(str(tmp_path / "ckpt"))
        assert {p.name for p in (tmp_path / "ckpt" / "rng").iterdir()} == {"rank0.pt", "rank1.pt"}
        graph.trainer.check_storage(str(tmp_path / "shared"))  # both ranks see it: nothing to say
        # fsspec's in-memory file system is private to each process, like a directory local to one node
        with pytest.raises(RaytoolError, match=r"^trainer\.checkpoint_dir=memory://node-local: trainer rank 1 \(node [\d.]+\) does not see "
                                                r"the files rank\(s\) 0 wrote there.*fsspec URI"):
            graph.trainer.check_storage("memory://node-local")
        saved = load_file(Path(graph.trainer.export_hf(str(tmp_path / "hf"))) / "model.safetensors")
        base = load_file(Path(graph.model_path) / "model.safetensors")
        name = "model.layers.0.mlp.up_proj.weight"
        assert saved[name].shape == base[name].shape and not torch.equal(saved[name], base[name])
    finally:
        graph.shutdown()


@pytest.mark.parametrize("route", ["tcp", "in_place", "collective"])
def test_a_dead_server_is_ejected_and_the_others_still_get_the_weights(ray_cluster, monkeypatch, route):
    """Three servers, rollout-server-1 gone (and, here, not caught by the health check). Over TCP
    the buckets relay down the chain of servers 0 -> 1 -> 2: server 0 cannot forward and server 2
    starves. Read in place, each server gets its own bucket headers and the sender waits in vain
    for server 1's ack. By a collective (gloo), the sender sees server 1's connection down and
    names it; the others starve in the aborted group. Either way the others are synced again
    without rollout-server-1 (by a collective: in a new group), which alone is ejected. (Over TCP
    and by a collective, first: a server Ray restarted before it served a request listens on new
    ports the manager never heard of; the sync asks the servers and reaches it, and it joins.)"""
    import time

    import ray

    from actors.common import wait_until_alive
    from actors.drivers.compose import Graph, build

    cfg = load_config(None, TINY + ["rollout.engine=hf", "rollout.num_servers=3", "rollout.num_cpus=0.3", "trainer.num_cpus=0.5",
                                    f"trainer.weight_sync_in_place={route == 'in_place'}",
                                    f"trainer.weight_sync_backend={'collective' if route == 'collective' else 'zmq'}"])
    graph = build(cfg)
    try:
        first = graph.sync_weights(version=1)
        assert {a.server for a in first.acks} == {"rollout-server-0", "rollout-server-1", "rollout-server-2"}
        assert first.sent["kind"] == {"tcp": "bytes", "in_place": "shm", "collective": "collective"}[route]
        assert {a.attestation for a in first.acks} == {first.sent["attestation"]}  # every server attested what the trainer sent
        version = 1
        if route != "in_place":
            server = graph.servers["rollout-server-0"]
            before = ray.get(server.health.remote()).pid
            ray.kill(server, no_restart=False)
            deadline = time.monotonic() + 60
            while True:  # the kill is asynchronous: the old process may answer once more
                assert wait_until_alive(server, 60) and time.monotonic() < deadline
                try:
                    if ray.get(server.health.remote()).pid != before:
                        break
                except ray.exceptions.RayActorError:
                    pass
                time.sleep(0.2)
            start, version = time.monotonic(), 2
            result = graph.sync_weights(version=version, timeout_s=30)
            assert {a.server for a in result.acks} == set(graph.servers) and not result.failed, result
            assert time.monotonic() - start < 30  # not a send to the old ports, waiting out its timeout
        ray.kill(graph.servers["rollout-server-1"], no_restart=True)
        monkeypatch.setattr(Graph, "_receivers", lambda self, targets: (targets, {}))
        result = graph.sync_weights(version=version + 1, timeout_s=5)
        assert sorted(a.server for a in result.acks) == ["rollout-server-0", "rollout-server-2"]
        assert all(a.version == version + 1 for a in result.acks) and set(result.failed) == {"rollout-server-1"}
        assert "rollout-server-1" in ray.get(graph.manager.stats.remote()).ejected
    finally:
        graph.shutdown()


def test_training_survives_a_rollout_server_killed_during_step_one(ray_cluster, tmp_path):
    """Two servers; `kill -9` of one server's process while step 1 rolls out: its requests
    complete on the other, the weight sync goes to the healthy one, every step completes. (The HF
    engine: the subject is the pipeline's handling of a dead server; a killed vLLM server and
    engine core are the weight-sync test's above.)"""
    import os
    import signal
    import threading
    import time

    import ray
    from actors.common import live_actors
    from actors.drivers.pipeline import run

    cfg = load_config(None, TINY + [
        "rollout.engine=hf", "rollout.num_servers=2", "rollout.num_cpus=0.5", "trainer.num_cpus=0.5", "trainer.total_steps=3",
        "data.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens_per_turn=48", "agent.max_response_tokens=96",
        f"cluster.namespace=raytool-killed-server-{os.getpid()}",
    ])
    run_dir = tmp_path / "killed"
    killed: dict = {}

    def kill_during_step_one():
        sft = run_dir / "sft_metrics.jsonl"
        deadline = time.time() + 400
        while time.time() < deadline and not (sft.exists() and len(sft.read_text().splitlines()) == 2):
            time.sleep(0.1)
        alive = live_actors(cfg.cluster.namespace, "RolloutServer")
        victim = sorted(alive, key=lambda a: a.pid)[0]
        # Killed while step 1's requests run on it (past the SFT weight sync, however slow the machine):
        # the planes see the failure, the control plane confirms it, and step 1's sync leaves it out.
        handle = ray.get_actor(victim.name, namespace=victim.ray_namespace)
        while time.time() < deadline and ray.get(handle.progress.remote()).in_flight == 0:
            time.sleep(0.05)
        if time.time() >= deadline:
            return  # never reached step 1's rollout: "the server was not killed" says so
        os.kill(victim.pid, signal.SIGKILL)
        killed["pid"] = victim.pid

    killer = threading.Thread(target=kill_during_step_one, daemon=True)
    killer.start()
    run(cfg, run_dir)
    killer.join(timeout=5)
    assert killed, "the server was not killed"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout/trajectories"] == 16 for m in steps)
    # Step 1's sync leaves the dead server out once the control plane has confirmed its death; on a
    # slow machine the confirmation can come after the sync started, which then counts it failed.
    # Where Ray restarted it and the control plane's probe found it on the base weights before step 1's
    # sync (a busy host stretches step 1 past its restart: seen once in the whole suite, 2026-11-30),
    # that sync re-loads it and re-admits it: two healthy servers, none failed, the death seen (a retry).
    first = steps[0]
    assert (first["rollout/servers_healthy"] == 1 and first["weight_sync/failed_servers"] in (0, 1)) or \
        (first["rollout/servers_healthy"] == 2 and first["weight_sync/failed_servers"] == 0 and first["rollout/retries"] >= 1), first
    assert [m["policy_version"] for m in steps] == [2, 3, 4]
