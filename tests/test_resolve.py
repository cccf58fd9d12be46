"""The config resolved once (raytool.resolve): every auto decided before any actor starts, the
same answer the second time, and the derived flags defined on the config."""

from __future__ import annotations

import pytest

from raytool.config import load_config, to_yaml
from raytool.resolve import resolve


def test_the_autos_are_decided_and_a_resolved_config_comes_back_unchanged():
    sync = resolve(load_config(None, ["model.path=tiny-random", "async.max_staleness=0"]))
    asyn = resolve(load_config(None, ["model.path=tiny-random", "async.max_staleness=2"]))
    assert sync.algorithm.rollout_correction.rollout_is is None and asyn.algorithm.rollout_correction.rollout_is == "token"
    assert sync.model.dtype != "auto"  # the engine's dtype on this machine's CPU
    assert resolve(sync) == sync and resolve(asyn) == asyn
    assert "auto" not in to_yaml(sync).split("rollout_correction:")[1].split("\n")[1]  # config.yaml records the decision
    chosen = resolve(load_config(None, ["model.path=tiny-random", "algorithm.rollout_correction.rollout_is=sequence"]))
    assert chosen.algorithm.rollout_correction.rollout_is == "sequence"  # what the user named is kept


def test_kl_on_is_one_definition_for_the_loss_and_the_reward_term():
    assert not load_config(None, []).algorithm.kl_on
    assert load_config(None, ["algorithm.kl_loss_coef=0.01"]).algorithm.kl_on
    assert load_config(None, ["algorithm.kl_reward_coef=0.01"]).algorithm.kl_on


def test_an_e2b_sandbox_that_dies_before_its_trajectory_may_end_is_refused_at_start(tmp_path):
    """The tool file's sandbox_timeout sets the sandbox's lifetime; one shorter than
    agent.max_trajectory_s would lose the interpreter's state mid-trajectory: one line naming both keys."""
    from raytool.config import ConfigError
    from raytool.resolve import resolve

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: raytool.tools.CodeInterpreterTool\n    config: {e2b_domain: sandbox.example.com, sandbox_timeout: 300}\n")
    with pytest.raises(ConfigError, match=r"sandbox.e2b_sandbox_timeout_s' is 300 s, shorter than a trajectory may run \(agent.max_trajectory_s=600\)"):
        resolve(load_config(None, [f"agent.tools={tools}"]))
    assert resolve(load_config(None, [f"agent.tools={tools}", "agent.max_trajectory_s=300"])).sandbox.e2b_sandbox_timeout_s == 300
    with pytest.raises(ConfigError, match="at least 900"):
        load_config(None, ["sandbox.backend=e2b", "agent.max_trajectory_s=900"])


def test_agent_workers_auto_keep_every_rollout_server_full(caplog):
    """4 servers of 256 sequences and 256 trajectories a worker: 4 workers (one left them at a quarter);
    a set value that cannot fill them is kept and said once."""
    import logging

    cfg = load_config(None, ["rollout.num_servers=4", "rollout.max_batch_size=256", "agent.max_concurrent_trajectories=256"])
    assert cfg.agent.num_workers == "auto" and resolve(cfg).agent.num_workers == 4
    assert resolve(load_config(None)).agent.num_workers == 1  # the CPU default: one server of 64
    with caplog.at_level(logging.WARNING, logger="raytool.resolve"):
        kept = resolve(load_config(None, ["rollout.num_servers=4", "rollout.max_batch_size=256", "agent.num_workers=1"]))
    assert kept.agent.num_workers == 1 and "keeps at most 256 trajectories in flight, where 4 rollout servers run 1024" in caplog.text


def test_an_unknown_or_critic_needing_algorithm_is_refused_before_anything_starts():
    """verl's algorithm.adv_estimator=gae was accepted, then failed after the first rollout."""
    from raytool.config import ConfigError

    with pytest.raises(ConfigError, match=r"'algorithm.adv_estimator': GAE needs a critic .* registered: grpo, rloo"):
        resolve(load_config(None, ["algorithm.adv_estimator=gae"]))
    with pytest.raises(ConfigError, match=r"'algorithm.policy_loss': unknown policy loss 'ppo_clipp'; registered: .*ppo_clip"):
        resolve(load_config(None, ["algorithm.policy_loss=ppo_clipp"]))
    assert resolve(load_config(None, ["algorithm.adv_estimator=rloo"])).algorithm.adv_estimator == "rloo"


def test_the_weight_sync_backend_is_decided_by_where_the_weights_are_and_a_missing_backend_is_refused():
    import torch.distributed as dist

    from raytool.config import ConfigError

    assert resolve(load_config(None, [])).trainer.weight_sync_backend == "zmq"  # CPU weights: the TCP chain, in place on one node
    assert resolve(load_config(None, ["trainer.weight_sync_backend=collective"])).trainer.weight_sync_backend == "collective"  # gloo
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL: the refusal is for a build without it")
    # auto on a GPU trainer: collective where this torch has NCCL, else the TCP path (said in the log)
    assert resolve(load_config(None, ["trainer.num_gpus=1"])).trainer.weight_sync_backend == "zmq"
    with pytest.raises(ConfigError, match=r"^config key 'trainer.weight_sync_backend': collective syncs cuda weights with nccl, but this torch "
                                          r"build has no NCCL backend \(a CPU-only torch\?\); set it to zmq$"):
        resolve(load_config(None, ["trainer.num_gpus=1", "trainer.weight_sync_backend=collective"]))
