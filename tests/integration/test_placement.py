"""On the session's cluster: the one-line error of a run the cluster cannot hold, and an actor that
fails to start reported by its role (placement on multi-node topologies: test_multinode_placement.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "trainer.total_steps=1", "trainer.sft_warmup_steps=0", "rollout.n=2", "data.prompts_per_step=2",
        "rollout.engine=hf", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=48", "eval.before_train=false", "eval.after_train=false"]


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
    namespace = f"raytool-failed-start-{tmp_path.name}"  # its own: other runs' actors on the cluster are not this one's
    done = run_cli(ray_cluster, tmp_path, f"reward.fn={reward}:score", "rollout.num_cpus=0.5", "trainer.num_cpus=0.5", f"cluster.namespace={namespace}")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raytool: reward-worker-0 failed to start: "), last
    assert "No module named 'package_of_the_driver_only'" in last
    log = tmp_path / "run" / "run.log"
    assert last.endswith(f"(traceback in {log})")
    text = log.read_text()
    assert "Traceback" in text and "reward_worker.py" in text and "package_of_the_driver_only" in text
    # nothing of the failed run is left on the cluster: its live actors, as a run's end asks for them
    # (the state API filters by state at the source and by namespace after; all the session's
    # actors, filtered by namespace, held none of this run's in two full runs, 2026-11-28)
    import ray

    from actors.common import actors_left

    assert actors_left(namespace, wait_s=60) == [] and ray.is_initialized()  # ray.kill is asynchronous
