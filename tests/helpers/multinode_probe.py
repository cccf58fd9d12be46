"""Start Ray's multi-node test cluster (several raylets on this machine, each with its own
resources), build a run's actors on it and print where each landed, as one JSON object.

Run by tests/integration/test_placement.py in a subprocess: a driver attaches to one cluster,
and the test session already has its own.

    python tests/helpers/multinode_probe.py
"""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.cluster_utils import Cluster

from actors.common import live_actors
from actors.drivers.compose import build
from actors.trainer import TrainerGroup
from raytool.config import load_config
from raytool.errors import RaytoolError

# A CPU head, a GPU node (fake: Ray counts what it is told), a CPU node for sandboxes and an
# Ascend node that advertises NPUs as `ray start --resources '{"NPU": 4}'` does.
NODES = {
    "head": {"num_cpus": 1, "resources": {"head": 1}},
    "gpu": {"num_cpus": 2, "num_gpus": 2, "resources": {"gpu_node": 1}},
    "sandbox": {"num_cpus": 1, "resources": {"sandbox": 4}},
    "npu": {"num_cpus": 2, "resources": {"NPU": 4}},
}
BASE = ["model.path=tiny-random", "model.dtype=float32", "rollout.engine=hf", "cluster.torch_threads=1"]


def actor_nodes(namespace: str) -> dict:
    """{actor name: node label} of the live actors in `namespace`."""
    ids = labels_by_id()
    return {a.name: ids.get(a.node_id) for a in live_actors(namespace)}


def labels() -> dict:
    out = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        res = node["Resources"]
        label = next((k for k in ("head", "gpu_node", "sandbox", "NPU") if k in res), None)
        out[{"gpu_node": "gpu", "NPU": "npu"}.get(label, label)] = node
    return out


def environment(worker, keys: list[str]) -> dict:
    return ray.get(worker.__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in keys}))


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args=NODES["head"])
    for name in ("gpu", "sandbox", "npu"):
        cluster.add_node(**NODES[name])
    ray.init(address=cluster.address, log_to_driver=False)
    out = {}
    try:
        # GPU placement: the servers on the GPU node, the sandbox pools on the sandbox node, the
        # trainer's two workers packed into one placement group there too.
        cfg = load_config(None, BASE + ["rollout.num_servers=2", "rollout.num_gpus=0.5", "rollout.num_cpus=0.25",
                                        "sandbox.num_pools=2", "sandbox.pool_resources={sandbox: 1}", "sandbox.warm_sessions=1",
                                        "trainer.num_workers=2", "trainer.num_gpus=0.5", "trainer.num_cpus=0.5",
                                        "cluster.namespace=probe-gpu"])
        graph = build(cfg)
        out["gpu_run"] = actor_nodes("probe-gpu")
        bundles = ray.util.placement_group_table(graph.trainer.pg)["bundles_to_node_id"]
        out["gpu_run_trainer_bundles"] = sorted(labels_by_id()[node] for node in bundles.values())
        out["gpu_run_trainer_env"] = environment(graph.trainer.workers[0], ["CUDA_VISIBLE_DEVICES"])
        graph.shutdown()
        # NPU placement: a trainer asking for NPUs lands on the Ascend node with HCCL's settings and
        # the NPUs Ray assigned in ASCEND_RT_VISIBLE_DEVICES.
        npu = load_config(None, BASE + ["cluster.accelerator=NPU", "trainer.num_gpus=2", "trainer.num_cpus=1",
                                        "cluster.env_vars={HCCL_IF_IP: 127.0.0.1}"])
        trainer = TrainerGroup(npu, graph.model_path, namespace="probe-npu")
        out["npu_run"] = actor_nodes("probe-npu")
        out["npu_env"] = environment(trainer.workers[0], ["ASCEND_RT_VISIBLE_DEVICES", "HCCL_CONNECT_TIMEOUT", "HCCL_IF_IP"])
        trainer.shutdown()
        # More GPUs than the cluster has: one line naming GPU, before any actor starts.
        for name, overrides in {"too_many_gpus": ["rollout.num_servers=3", "rollout.num_gpus=1"],
                                "too_big_for_a_node": ["trainer.num_gpus=4"]}.items():
            try:
                build(load_config(None, BASE + overrides))
                out[name] = None
            except RaytoolError as exc:
                out[name] = str(exc)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


def labels_by_id() -> dict:
    return {node["NodeID"]: label for label, node in labels().items()}


if __name__ == "__main__":
    sys.exit(main())
