"""Placement on multi-node topologies: Ray's multi-node test cluster (several raylets on this
machine, each with its own resources) started by tests/helpers/multinode_probe.py in a process of
its own, not the session's cluster (so this file runs in the suite's other worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


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
