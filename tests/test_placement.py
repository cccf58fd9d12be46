"""What a run asks of the cluster, and the one-line reason when the cluster can never give it."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.common import actor_options
from raytool.config import ConfigError, load_config
from raytool.errors import start_failure
from raytool.placement import PlacementError, check, demands, shortfall

TWO_CORES = [{"CPU": 2.0, "memory": 8e9}]


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_the_default_run_fits_a_two_core_machine():
    assert shortfall(demands(cfg()), TWO_CORES) is None


def test_two_servers_on_two_cores_name_the_cpus_and_the_keys():
    with pytest.raises(PlacementError) as err:
        check(demands(cfg("rollout.num_servers=2")), TWO_CORES)
    line = str(err.value)
    assert "needs 3 CPU (2 rollout servers x 1, 1 trainer worker x 1) but the cluster has 2" in line
    assert "missing resource CPU" in line and "rollout.num_cpus" in line and "trainer.num_cpus" in line and "\n" not in line


def test_an_actor_larger_than_every_node_is_named_even_when_the_totals_suffice():
    nodes = [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 4.0}]
    reason = shortfall(demands(cfg("rollout.num_gpus=8")), nodes)
    assert reason.startswith("no node can hold one rollout server, which asks for 1 CPU, 8 GPU: the largest node has 4 GPU")


def test_npu_requests_count_the_npu_resource_and_a_gpu_request_on_npus_says_what_to_set():
    npu_nodes = [{"CPU": 4.0}, {"CPU": 96.0, "NPU": 8.0}]
    assert shortfall(demands(cfg("cluster.accelerator=NPU", "trainer.num_gpus=8", "rollout.num_gpus=0")), npu_nodes) is None
    reason = shortfall(demands(cfg("trainer.num_gpus=8")), npu_nodes)
    assert "missing resource GPU" in reason and reason.endswith("this cluster has NPUs: set cluster.accelerator=NPU")


def test_sandbox_pools_ask_for_their_custom_resource():
    wanted = demands(cfg("sandbox.num_pools=2", "sandbox.pool_resources={sandbox: 1}"))
    assert [d.bundle for d in wanted if d.role == "sandbox pool"] == [{"sandbox": 1.0}]
    reason = shortfall(wanted, TWO_CORES)
    assert "sandbox pool" in reason and "missing resource sandbox" in reason and "sandbox.pool_resources" in reason


def test_actor_options_put_npus_in_custom_resources_with_hccl_settings():
    opts = actor_options(1, 2, "NPU", {"HCCL_IF_IP": "10.0.0.1"}, resources={"sandbox": 1})
    assert opts["resources"] == {"sandbox": 1, "NPU": 2} and "num_gpus" not in opts
    env = opts["runtime_env"]["env_vars"]
    assert env["HCCL_IF_IP"] == "10.0.0.1" and env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"  # weights in plain layout, which weight syncs write
    with pytest.raises(ConfigError, match="VLLM_ASCEND_ENABLE_NZ=1 lets vllm-ascend hold weights in the FRACTAL_NZ layout"):
        load_config(None, ["cluster.env_vars={VLLM_ASCEND_ENABLE_NZ: '1'}"])
    gpu = actor_options(1, 2)
    assert gpu["num_gpus"] == 2 and "resources" not in gpu and "HCCL_CONNECT_TIMEOUT" not in gpu["runtime_env"]["env_vars"]


def test_a_failed_start_is_described_by_the_constructor_s_exception():
    text = ("The actor died because of an error raised in its creation task, ray::RewardWorker.__init__() (pid=1, ip=1)\n"
            "  File \"/x/reward_worker.py\", line 14, in __init__\n    self.reward = make_reward_fn(cfg)\n"
            "raytool.rewards.RewardError: reward.fn 'x.py:f': no such file")
    assert start_failure(RuntimeError(text)) == "raytool.rewards.RewardError: reward.fn 'x.py:f': no such file"


def test_an_engine_and_a_trainer_on_shares_of_one_gpu_start_one_after_the_other():
    """The one-GPU LoRA recipe gives the engine 0.4 of the GPU and the trainer 0.6: the trainer loads
    only once vLLM has measured the memory it may take; whole accelerators each start at once."""
    from raytool.placement import shares_accelerators

    examples = Path(__file__).resolve().parents[1] / "examples"
    assert shares_accelerators(load_config(examples / "gsm8k_lora_qwen2.5_1.5b.yaml"))
    assert not shares_accelerators(load_config(examples / "retool_qwen2.5_32b_sandbox_fusion.yaml"))
    assert not shares_accelerators(load_config(None))  # CPUs only
