"""verl's config keys in a raytool config: the ones raytool has under another name are read as
that key (one notice line each); the ones it has no counterpart for are refused in one line saying
why. docs/verl.md shows both tables, and a test keeps it equal to them.

A verl user's overrides (`data.train_batch_size=512 actor_rollout_ref.actor.optim.lr=1e-6`) and a
YAML written in verl's nesting are both translated, before the config's keys and types are checked.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# verl key -> raytool key (the same meaning and unit).
ALIASES: dict[str, str] = {
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_response_length": "agent.max_response_tokens",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "trainer.activation_checkpointing",
    "actor_rollout_ref.model.use_liger": "trainer.kernels",
    "actor_rollout_ref.model.lora_rank": "trainer.lora_rank",
    "actor_rollout_ref.model.lora_alpha": "trainer.lora_alpha",
    "actor_rollout_ref.model.target_modules": "trainer.lora_target_modules",
    "actor_rollout_ref.actor.optim.lr": "trainer.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "trainer.warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "trainer.weight_decay",
    "actor_rollout_ref.actor.optim.min_lr_ratio": "trainer.min_lr_ratio",
    "actor_rollout_ref.actor.grad_clip": "trainer.grad_clip",
    "actor_rollout_ref.actor.ppo_epochs": "algorithm.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "trainer.micro_batch_tokens",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "trainer.sequence_parallel_size",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_batch_size",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.val_kwargs.n": "eval.n",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "eval.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "eval.top_p",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "agent.max_turns",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "agent.max_tool_calls_per_turn",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "agent.tools",
    "actor_rollout_ref.rollout.multi_turn.format": "agent.format",
    "actor_rollout_ref.rollout.agent.num_workers": "agent.num_workers",
    "actor_rollout_ref.rollout.agent.default_agent_loop": "agent.default_agent",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_reward_coef",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.logger": "logging.logger",
    "trainer.project_name": "logging.project_name",
    "trainer.experiment_name": "logging.experiment_name",
    "trainer.nnodes": "cluster.nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "eval.every",
    "trainer.val_before_train": "eval.before_train",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
}

# verl key -> why raytool has no key for it (and what to use instead).
NOT_APPLICABLE: dict[str, str] = {
    "data.max_prompt_length": "raytool leaves out prompts that do not fit rollout.max_model_len with agent.max_response_tokens after them, named in one line",
    "data.return_raw_chat": "raytool always renders the chat itself (token-exact, raytool.agent.render)",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "raytool counts mini-batches per step: algorithm.mini_batches = data.train_batch_size / ppo_mini_batch_size",
    "actor_rollout_ref.actor.use_kl_loss": "a KL loss is on when algorithm.kl_loss_coef > 0",
    "actor_rollout_ref.actor.kl_loss_type": "the values differ: set algorithm.kl_type (k1, k2, k3; verl's low_var_kl is k3)",
    "actor_rollout_ref.actor.use_dynamic_bsz": "raytool always packs micro-batches by token budget (trainer.micro_batch_tokens)",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "verl moves the parameters to the host between phases, to make room for the rollout it colocates; raytool's rollout servers have accelerators of their own, so nothing moves. trainer.cpu_offload is another thing (FSDP2 keeps parameters on the host for every step, measured 5.4x slower on an H100): only for a model `raytool plan` says the trainer's accelerators cannot hold",
    "actor_rollout_ref.rollout.name": "vLLM is raytool's engine (rollout.engine: vllm, or hf for tests)",
    "actor_rollout_ref.rollout.mode": "raytool's rollout is always the asynchronous server mode",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "verl counts characters; raytool's agent.tool_output_tokens counts tokens",
    "algorithm.use_kl_in_reward": "KL in the reward is on when algorithm.kl_reward_coef > 0",
    "custom_reward_function.path": "raytool names the file and the function in one key: reward.fn=path/to/file.py:function (verl's compute_score signature works)",
    "custom_reward_function.name": "raytool names the file and the function in one key: reward.fn=path/to/file.py:function",
    "reward_model.reward_manager": "raytool scores each trajectory as it finishes on reward workers (reward.num_workers)",
    "trainer.total_epochs": "raytool counts steps: trainer.total_steps",
    "trainer.resume_mode": "resume with `raytool train --resume [RUN_DIR|CHECKPOINT]`",
    "trainer.device": "raytool takes the device from the resources: trainer.num_gpus and cluster.accelerator",
}

VERL_ONLY_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "ray_init", "global_profiler")
_LISTS = {"data.train_files", "data.val_files"}  # verl takes one path or a list; raytool a list


class VerlKeyError(ValueError):
    """A verl key raytool cannot take; the message says why and what to use."""


def _leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in ALIASES:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def _pop(raw: dict, path: str) -> None:
    parts = path.split(".")
    nodes = [raw]
    for part in parts[:-1]:
        nodes.append(nodes[-1][part])
    del nodes[-1][parts[-1]]
    for node, part in zip(reversed(nodes[:-1]), reversed(parts[:-1])):  # drop sections left empty
        if node[part] == {}:
            del node[part]


def _put(raw: dict, path: str, value) -> None:
    node = raw
    for part in path.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[path.split(".")[-1]] = value


def translate(raw: dict) -> dict:
    """`raw` (a parsed config, overrides applied) with verl's keys moved to raytool's; raises
    VerlKeyError for a verl key raytool has no counterpart for."""
    for path, value in list(_leaves(raw)):
        if path in NOT_APPLICABLE:
            raise VerlKeyError(f"verl key '{path}' has no raytool counterpart: {NOT_APPLICABLE[path]} (docs/verl.md)")
        if path in _LISTS and isinstance(value, str):
            _put(raw, path, [value])
        if path in ALIASES:
            target = ALIASES[path]
            if target in dict(_leaves(raw)):
                raise VerlKeyError(f"verl key '{path}' and raytool's '{target}' are both given: keep one")
            _pop(raw, path)
            _put(raw, target, value)
            log.info("verl key '%s' read as raytool's '%s'", path, ALIASES[path])
        elif path.split(".")[0] in VERL_ONLY_SECTIONS:
            raise VerlKeyError(f"verl key '{path}' is not one raytool maps (docs/verl.md lists those it does, and why the others do not apply)")
    return raw
