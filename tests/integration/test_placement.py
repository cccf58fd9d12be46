"""Placement on multi-node topologies (Ray's multi-node test cluster: several raylets on this
machine, each with its own resources), the one-line error of a run the cluster cannot hold, and an
actor that fails to start reported by its role."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "trainer.total_steps=1", "trainer.sft_warmup_steps=0", "rollout.n=2", "data.prompts_per_step=2",
        "rollout.engine=hf", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=48", "eval.before_train=false", "eval.after_train=false"]


@pytest.fixture(scope="module")
def probe():
    """Where a run's actors land on a head + GPU node + sandbox node + Ascend node cluster."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "tests/helpers/multinode_probe.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_actors_are_named_by_role_and_land_on_the_nodes_their_resources_name(probe):
    placed = probe["gpu_run"]
    assert set(placed) == {"rollout-server-0", "rollout-server-1", "llm-manager", "sandbox-pool-0", "sandbox-pool-1",
                           "reward-worker-0", "agent-worker-0", "trainer-0", "trainer-1"}
    assert placed["rollout-server-0"] == placed["rollout-server-1"] == "gpu"
    assert placed["sandbox-pool-0"] == placed["sandbox-pool-1"] == "sandbox"
    # the trainer group: one placement group, both bundles on the GPU node, each worker a GPU of its own
    assert placed["trainer-0"] == placed["trainer-1"] == "gpu" and probe["gpu_run_trainer_bundles"] == ["gpu", "gpu"]
    assert probe["gpu_run_trainer_env"]["CUDA_VISIBLE_DEVICES"] in {"0", "1"}


def test_npu_requests_land_on_the_ascend_node_with_hccl_settings_and_visible_devices(probe):
    assert probe["npu_run"] == {"trainer-0": "npu"}
    env = probe["npu_env"]
    assert sorted(env["ASCEND_RT_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800" and env["HCCL_IF_IP"] == "127.0.0.1"


def test_a_placement_the_cluster_cannot_satisfy_is_one_line_naming_the_resource(probe):
    assert "needs 3 GPU (3 rollout servers x 1) but the cluster has 2 (missing resource GPU" in probe["too_many_gpus"]
    assert "no node can hold one trainer worker, which asks for 1 CPU, 4 GPU: the largest node has 2 GPU" in probe["too_big_for_a_node"]


def run_cli(ray_cluster, tmp_path, *overrides, timeout=300):
    cmd = [sys.executable, "-m", "raytool.cli", "train", *TINY, *overrides, "--address", ray_cluster.address, "--run-dir", str(tmp_path / "run")]
    return subprocess.run(cmd, cwd=REPO, env=ray_cluster.env, capture_output=True, text=True, timeout=timeout)


def test_more_servers_than_the_cluster_has_cpus_stops_at_once_instead_of_waiting(ray_cluster, tmp_path):
    """The session's head has 2 CPUs: three servers and a trainer ask for 4."""
    done = run_cli(ray_cluster, tmp_path, "rollout.num_servers=3")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raytool: cannot place the run's actors: the run needs 4 CPU (3 rollout servers x 1, 1 trainer worker x 1) but the cluster has 2")
    assert "rollout.num_cpus" in last


def test_an_actor_that_fails_to_start_is_named_with_its_cause_and_the_traceback_is_in_the_run_log(ray_cluster, tmp_path):
    """A reward fn file that imports in the driver (the start's checks pass) but not inside an
    actor, as one that needs a package only the driver's machine has."""
    reward = tmp_path / "driver_only_reward.py"
    reward.write_text("import ray\nif ray.get_runtime_context().get_actor_id():\n"
                      "    raise ModuleNotFoundError(\"No module named 'package_of_the_driver_only'\")\n"
                      "def score(view, ground_truth, extra):\n    return 0.0\n")
    done = run_cli(ray_cluster, tmp_path, f"reward.fn={reward}:score", "rollout.num_cpus=0.5", "trainer.num_cpus=0.5")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raytool: reward-worker-0 failed to start: "), last
    assert "No module named 'package_of_the_driver_only'" in last
    log = tmp_path / "run" / "run.log"
    assert last.endswith(f"(traceback in {log})")
    text = log.read_text()
    assert "Traceback" in text and "reward_worker.py" in text and "package_of_the_driver_only" in text
    # nothing of the failed run is left on the cluster
    import ray
    from ray.util.state import list_actors

    import time

    deadline = time.monotonic() + 60  # ray.kill is asynchronous, and the state API lags (or times out) on a busy machine
    run_actors: dict = {}
    while True:
        try:
            run_actors = {a.name: a.state for a in list_actors(limit=10_000, address=ray.get_runtime_context().gcs_address) if a.ray_namespace.startswith("raytool-run-")}
        except ray.exceptions.RpcError:  # the state API timed out on a loaded machine (seen in a full run): ask again
            pass
        if set(run_actors.values()) == {"DEAD"} or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert "reward-worker-0" in run_actors and "llm-manager" in run_actors and ray.is_initialized()
    assert set(run_actors.values()) == {"DEAD"}, run_actors
