"""verl's config keys in a raytool config, all read in one pass (`translate`, called by
raytool.config before the keys and types are checked):

- ALIASES: the same knob under another name, read as the raytool key;
- ALWAYS: knobs whose values ask for what raytool always does (or what changes only memory or
  speed there): accepted, and named in one notice block with what raytool does instead;
- DERIVED: keys whose raytool value is computed, from them and from others (epochs -> steps,
  mini-batch size -> mini-batches, the reward file and function -> reward.fn, the KL switches, -1
  frequencies, the GPU counts -> trainer ranks and rollout servers; `derive`);
- NOT_APPLICABLE: keys that would change the result and that raytool cannot honour.

Every refusal of one config comes in one message, each line with why and the nearest raytool
knob; so does every key neither raytool nor verl knows (with the nearest of each). A verl key
given on the command line overrides the config file's value of the same knob; the same knob given
twice in the same place is refused. docs/verl.md shows the tables, and a test keeps it equal to them.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field

from raytool.console import CONSOLE

log = logging.getLogger(__name__)

AR = "actor_rollout_ref"
GPUS = "trainer.nnodes x trainer.n_gpus_per_node"

# verl key -> raytool key (the same meaning and unit).
ALIASES: dict[str, str] = {
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "agent.max_response_tokens",
    f"{AR}.model.path": "model.path",
    f"{AR}.model.enable_gradient_checkpointing": "trainer.activation_checkpointing",
    f"{AR}.model.use_liger": "trainer.kernels",
    f"{AR}.model.lora_rank": "trainer.lora_rank",
    f"{AR}.model.lora_alpha": "trainer.lora_alpha",
    f"{AR}.model.target_modules": "trainer.lora_target_modules",
    f"{AR}.actor.optim.lr": "trainer.lr",
    f"{AR}.actor.optim.lr_warmup_steps": "trainer.warmup_steps",
    f"{AR}.actor.optim.weight_decay": "trainer.weight_decay",
    f"{AR}.actor.optim.min_lr_ratio": "trainer.min_lr_ratio",
    f"{AR}.actor.grad_clip": "trainer.grad_clip",
    f"{AR}.actor.ppo_epochs": "algorithm.ppo_epochs",
    f"{AR}.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    f"{AR}.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    f"{AR}.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    f"{AR}.actor.loss_agg_mode": "algorithm.loss_agg",
    f"{AR}.actor.entropy_coeff": "algorithm.entropy_coeff",
    f"{AR}.actor.ppo_max_token_len_per_gpu": "trainer.micro_batch_tokens",
    f"{AR}.actor.ulysses_sequence_parallel_size": "trainer.sequence_parallel_size",
    f"{AR}.rollout.n": "rollout.n",
    f"{AR}.rollout.temperature": "rollout.temperature",
    f"{AR}.rollout.top_p": "rollout.top_p",
    f"{AR}.rollout.top_k": "rollout.top_k",
    f"{AR}.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    f"{AR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{AR}.rollout.max_model_len": "rollout.max_model_len",
    f"{AR}.rollout.max_num_seqs": "rollout.max_batch_size",
    f"{AR}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{AR}.rollout.val_kwargs.n": "eval.n",
    f"{AR}.rollout.val_kwargs.temperature": "eval.temperature",
    f"{AR}.rollout.val_kwargs.top_p": "eval.top_p",
    f"{AR}.rollout.multi_turn.max_assistant_turns": "agent.max_turns",
    f"{AR}.rollout.multi_turn.max_parallel_calls": "agent.max_tool_calls_per_turn",
    f"{AR}.rollout.multi_turn.tool_config_path": "agent.tools",
    f"{AR}.rollout.multi_turn.format": "agent.format",
    f"{AR}.rollout.agent.num_workers": "agent.num_workers",
    f"{AR}.rollout.agent.default_agent_loop": "agent.default_agent",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_sampling_rounds",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.logger": "logging.logger",
    "trainer.project_name": "logging.project_name",
    "trainer.experiment_name": "logging.experiment_name",
    "trainer.nnodes": "cluster.nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
    "trainer.val_before_train": "eval.before_train",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.log_val_generations": "logging.val_trace_samples",
}

_OFFLOAD = ("verl moves this to the host between phases, to make room for the rollout it colocates; raytool's rollout servers "
            "have accelerators of their own, so nothing moves (trainer.cpu_offload keeps FSDP2's states on the host at every "
            "step: only for a model `raytool plan` says the trainer's accelerators cannot hold)")
_SIZING = "memory and speed only: raytool sizes every forward by tokens (trainer.micro_batch_tokens)"
_ENGINE = "an engine setting of memory and speed: raytool's vLLM servers keep their own (rollout.*)"

# verl key -> (the values that ask for what raytool does, None: any; what raytool does instead).
ALWAYS: dict[str, tuple[tuple | None, str]] = {
    "data.return_raw_chat": ((True,), "raytool always renders the chat itself from the rows' messages (token-exact, raytool.agent.render)"),
    "data.shuffle": ((True,), "raytool shuffles the training prompts (data.seed)"),
    "data.val_batch_size": (None, "raytool validates every prompt at once, as the rollout servers take them"),
    "data.dataloader_num_workers": (None, "raytool reads the data on the driver"),
    "data.prompt_key": (("prompt",), "raytool reads the messages from the rows' `prompt`"),
    "data.reward_fn_key": (("data_source",), "raytool groups rewards and metrics by the rows' `data_source`"),
    f"{AR}.hybrid_engine": ((True,), "raytool runs the rollout on servers of its own (disaggregated), and syncs the weights to them after each step"),
    f"{AR}.model.use_remove_padding": (None, "memory and speed only: raytool packs sequences when the attention allows it (model.attn_implementation)"),
    f"{AR}.model.use_fused_kernels": (None, "speed only (trainer.kernels chooses Liger-Kernel's)"),
    f"{AR}.model.trust_remote_code": (None, "raytool loads the model classes transformers ships"),
    f"{AR}.actor.strategy": (("fsdp", "fsdp2"), "raytool trains with FSDP2"),
    f"{AR}.ref.strategy": (("fsdp", "fsdp2"), "raytool's reference model is sharded like the policy"),
    f"{AR}.actor.use_dynamic_bsz": (None, "raytool always packs micro-batches by token budget (trainer.micro_batch_tokens)"),
    f"{AR}.actor.ppo_micro_batch_size": (None, _SIZING),
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": (None, _SIZING),
    f"{AR}.ref.log_prob_micro_batch_size_per_gpu": (None, _SIZING),
    f"{AR}.ref.log_prob_max_token_len_per_gpu": (None, _SIZING),
    f"{AR}.ref.log_prob_use_dynamic_bsz": (None, _SIZING),
    f"{AR}.ref.ulysses_sequence_parallel_size": (None, "the reference model runs with the policy's sequence parallelism (trainer.sequence_parallel_size)"),
    f"{AR}.rollout.log_prob_micro_batch_size_per_gpu": (None, _SIZING),
    f"{AR}.rollout.log_prob_max_token_len_per_gpu": (None, _SIZING),
    f"{AR}.rollout.log_prob_use_dynamic_bsz": (None, _SIZING),
    f"{AR}.actor.fsdp_config.param_offload": (None, _OFFLOAD),
    f"{AR}.actor.fsdp_config.optimizer_offload": (None, _OFFLOAD),
    f"{AR}.ref.fsdp_config.param_offload": (None, _OFFLOAD),
    f"{AR}.actor.checkpoint.save_contents": (None, "raytool's checkpoints always hold the model, the optimizer and the run's state"),
    f"{AR}.actor.checkpoint.load_contents": (None, "raytool's checkpoints always hold the model, the optimizer and the run's state"),
    f"{AR}.rollout.name": (None, "raytool's rollout engine is vLLM (rollout.engine): the engine differs, the sampling and the algorithm do not"),
    f"{AR}.rollout.mode": (None, "raytool's rollout is always served asynchronously, token in and token out"),
    f"{AR}.rollout.multi_turn.enable": ((True,), "raytool's agent loop is multi-turn (agent.max_turns)"),
    f"{AR}.rollout.multi_stage_wake_up": (None, "memory only: verl wakes its colocated engine in stages; raytool's engines stay up"),
    f"{AR}.rollout.free_cache_engine": (None, _ENGINE),
    f"{AR}.rollout.enable_chunked_prefill": (None, _ENGINE),
    f"{AR}.rollout.load_format": (None, "raytool's servers load the model.path checkpoint, then take the trainer's weights after each step"),
    f"{AR}.rollout.layered_summon": (None, "raytool gathers and sends the weights one tensor at a time"),
    f"{AR}.rollout.calculate_log_probs": (None, "raytool's engines always return the sampled tokens' log-probs"),
    f"{AR}.rollout.val_kwargs.do_sample": ((True,), "raytool samples validation at eval.temperature"),
    "algorithm.kl_ctrl.type": (("fixed",), "raytool's KL coefficients are fixed"),
    "algorithm.gamma": (None, "used only by GAE, which needs a critic raytool does not train"),
    "algorithm.lam": (None, "used only by GAE, which needs a critic raytool does not train"),
    "reward_model.enable": ((False,), "the reward is the function reward.fn (a model only as an LLM judge: reward.fn=judge)"),
    "critic.enable": ((False,), "GRPO has no critic"),
    "trainer.critic_warmup": ((0,), "GRPO has no critic"),
    "trainer.balance_batch": (None, "speed only: raytool packs micro-batches by tokens"),
    "trainer.resume_mode": (None, "raytool resumes when started with `raytool train --resume [RUN_DIR|CHECKPOINT]`, exactly"),
    "trainer.default_hdfs_dir": ((None,), "raytool writes checkpoints to trainer.checkpoint_dir (any fsspec URL)"),
    "trainer.del_local_ckpt_after_load": (None, "raytool keeps trainer.keep_checkpoints checkpoints"),
    "trainer.max_critic_ckpt_to_keep": (None, "GRPO has no critic"),
    "trainer.rollout_data_dir": (None, "raytool writes trajectories to RUN_DIR/traces.jsonl (logging.trace_samples a step)"),
    "trainer.validation_data_dir": (None, "raytool writes validation trajectories to RUN_DIR/val_traces.jsonl (logging.val_trace_samples)"),
    "ray_init.*": (None, "raytool joins the Ray cluster it is started in, or starts one with this machine's CPUs; the dashboard shows its actors"),
    "global_profiler.*": (None, "profiling only: raytool's own is `raytool bench`"),
    f"{AR}.rollout.over_sample_rate": (None, "raytool streams the groups and trains on those finished first (async.max_staleness), "
                                             "without aborting the others"),
    "data.gen_batch_size": (None, "with dynamic sampling raytool rolls out prompts until data.prompts_per_step groups with varying "
                                  "rewards are in hand (algorithm.max_sampling_rounds), not a fixed generation batch"),
    "algorithm.filter_groups.metric": (("acc", "score", "seq_reward", "seq_final_reward"), "raytool's dynamic sampling keeps the groups "
                                                                                           "whose rewards vary"),
}

# verl's SFT trainer (verl.trainer.fsdp_sft_trainer) names: its key -> raytool's (convert-verl).
SFT_ALIASES: dict[str, str] = {
    "data.train_files": "sft.train_files", "data.val_files": "sft.val_files", "data.max_length": "sft.max_length",
    "data.train_batch_size": "sft.batch_size", "optim.lr": "sft.lr", "optim.weight_decay": "trainer.weight_decay",
    "optim.clip_grad": "trainer.grad_clip", "trainer.total_epochs": "sft.epochs", "trainer.save_freq": "sft.save_every",
    "trainer.test_freq": "sft.val_every", "model.partial_pretrain": "model.path",
    "model.enable_gradient_checkpointing": "trainer.activation_checkpointing", "model.lora_rank": "trainer.lora_rank",
    "model.lora_alpha": "trainer.lora_alpha", "ulysses_sequence_parallel_size": "trainer.sequence_parallel_size",
}
SFT_ALWAYS: dict[str, tuple[tuple | None, str]] = {
    "data.multiturn.enable": ((True,), "raytool's SFT trains multi-turn conversations"),
    "data.multiturn.messages_key": (("messages",), "raytool reads the rows' `messages`"),
    "data.multiturn.tools_key": (("tools",), "raytool reads the rows' `tools`"),
    "data.micro_batch_size_per_gpu": (None, _SIZING),
    "model.strategy": (("fsdp", "fsdp2"), "raytool trains with FSDP2"),
    "use_remove_padding": (None, "memory and speed only: raytool packs sequences when the attention allows it (model.attn_implementation)"),
    "model.fsdp_config.*": (None, "raytool's FSDP2 settings (trainer.cpu_offload when `raytool plan` says so)"),
}

# verl keys whose raytool value `derive` computes (the table docs/verl.md shows).
DERIVED: dict[str, str] = {
    "custom_reward_function.path": "reward.fn=PATH:NAME (NAME: custom_reward_function.name, verl's default compute_score)",
    "custom_reward_function.name": "reward.fn=PATH:NAME",
    f"{AR}.actor.ppo_mini_batch_size": "algorithm.mini_batches = data.train_batch_size / ppo_mini_batch_size (must divide it)",
    f"{AR}.actor.use_kl_loss": "False: algorithm.kl_loss_coef=0; True: algorithm.kl_loss_coef = actor.kl_loss_coef (verl's default 0.001)",
    f"{AR}.actor.kl_loss_coef": "algorithm.kl_loss_coef, when actor.use_kl_loss is True",
    f"{AR}.actor.kl_loss_type": "algorithm.kl_type: kl -> k1, mse -> k2, low_var_kl -> k3",
    "algorithm.use_kl_in_reward": "False: algorithm.kl_reward_coef=0; True: algorithm.kl_reward_coef = kl_ctrl.kl_coef (verl's default 0.001)",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_reward_coef, when algorithm.use_kl_in_reward is True",
    "trainer.save_freq": "trainer.save_every (-1: 0, a checkpoint only at the end)",
    "trainer.test_freq": "eval.every (-1: 0, validation only before and after training)",
    f"{AR}.rollout.multi_turn.max_user_turns": "accepted when it is no less than max_assistant_turns (a tool turn follows an assistant turn)",
    "reward_model.reward_manager": "naive, prime: raytool's own per-trajectory scoring; dapo: with reward_model.overlong_buffer.* as reward.overlong_*",
    "reward_model.overlong_buffer.enable": "False: reward.overlong_buffer_tokens=0",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer_tokens (when enable is True)",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    "reward_model.overlong_buffer.log": "accepted: raytool logs the overlong share always",
    "data.custom_cls.path": "ReTool's CustomRLHFDataset: the rows `raytool preprocess dapo_math_17k` writes; another class: refused",
    "data.custom_cls.name": "see data.custom_cls.path",
    "data.filter_overlong_prompts": "True: data.overlong_prompts=drop (the prompts longer than data.max_prompt_tokens left out, named); False: verl's data.truncation (error)",
    "data.truncation": "error: data.overlong_prompts=error (the run stops at start naming the row); left, right, middle: refused (a cut prompt is not a conversation)",
    "trainer.device": "npu: cluster.accelerator=NPU; cuda: GPU",
    GPUS: "the GPUs the run may use: split into trainer ranks and rollout servers (`split_gpus`)",
}

# verl key -> why raytool cannot honour it, and the nearest raytool knob.
NOT_APPLICABLE: dict[str, str] = {
    f"{AR}.rollout.multi_turn.max_tool_response_length": "verl counts characters; raytool's agent.tool_output_tokens counts tokens",
    "trainer.val_only": "validation alone is `raytool eval -c CONFIG --checkpoint DIR`",
    f"{AR}.actor.optim.lr_warmup_steps_ratio": "raytool counts the warm-up in optimizer steps: trainer.warmup_steps",
    f"{AR}.actor.use_torch_compile": "trainer.compile (true, false or auto)",
}

VERL_ONLY_SECTIONS = (AR, "critic", "reward_model", "custom_reward_function", "ray_init", "global_profiler")
_LISTS = {"data.train_files", "data.val_files", "trainer.logger"}  # verl takes one value or a list; raytool a list
_KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


class VerlKeyError(ValueError):
    """verl keys raytool cannot take; the message has one line per key, with why and what to use."""


@dataclass
class Reading:
    """One pass over a config's verl keys: what moved where, what was accepted, what is refused."""

    raw: dict
    given: set[str]  # the keys typed on the command line (their origin decides conflicts)
    moved: list[tuple[str, str, object, str]] = field(default_factory=list)  # (verl key, raytool key, value, note)
    accepted: list[str] = field(default_factory=list)  # each starts with the verl key
    refused: list[str] = field(default_factory=list)

    def put(self, verl_key: str, target: str, value, note: str = "") -> None:
        """Set raytool's `target` from `verl_key`: a value the same knob already has from the other
        place (file or command line) is overridden by the command line's; from the same place, refused."""
        have = dict(leaves(self.raw))
        if target in have and have[target] != value:
            if (verl_key in self.given) == (target in self.given):
                self.refused.append(f"'{verl_key}' and raytool's '{target}' are both given ({value!r} and {have[target]!r}): keep one")
                return
            if target in self.given:  # raytool's key on the command line wins over the file's verl key
                self.moved.append((verl_key, target, have[target], "the command line's value kept"))
                return
        _put(self.raw, target, value)
        self.moved.append((verl_key, target, value, note))


def leaves(node: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a parsed config (a verl alias's dict value is one leaf)."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in ALIASES and value:
            yield from leaves(value, f"{path}.")
        else:
            yield path, value


def _pop(raw: dict, path: str):
    parts = path.split(".")
    nodes = [raw]
    for part in parts[:-1]:
        nodes.append(nodes[-1][part])
    value = nodes[-1].pop(parts[-1])
    for node, part in zip(reversed(nodes[:-1]), reversed(parts[:-1])):  # drop sections left empty
        if node[part] == {}:
            del node[part]
    return value


def _put(raw: dict, path: str, value) -> None:
    node = raw
    for part in path.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[path.split(".")[-1]] = value


def verl_keys() -> set[str]:
    """The verl keys raytool knows (every table's)."""
    return set(ALIASES) | set(ALWAYS) | {k for k in DERIVED if " " not in k} | set(NOT_APPLICABLE)


def _nearest(key: str, candidates: set[str]) -> str | None:
    found = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def split_gpus(total: int, tp: int, sp: int) -> tuple[int, int, bool]:
    """verl's GPUs (nodes x GPUs per node, which it colocates) as raytool's disaggregated roles:
    (trainer ranks, rollout servers of `tp` GPUs, shared). Half the GPUs train, in a multiple of
    the sequence-parallel size `sp`, the rest serve; where that leaves no server (or no trainer
    group), trainer and servers share every GPU (shared: each takes half of one)."""
    trainers = sp * max(1, (total // 2) // sp)
    servers = (total - trainers) // tp
    if servers >= 1 and trainers <= total:
        return trainers, servers, False
    if total % sp or total % tp or tp > 1:
        raise VerlKeyError(f"'trainer.nnodes x trainer.n_gpus_per_node' ({total} GPUs) is not a multiple of both the sequence-parallel "
                           f"size ({sp}, actor.ulysses_sequence_parallel_size) and the rollout's tensor-parallel size "
                           f"({tp}, rollout.tensor_model_parallel_size), or too few to give servers of {tp} GPUs their own beside the trainer's")
    return total, total // tp, True


def derive(r: Reading) -> None:
    """The DERIVED keys: each read (and removed) from r.raw, its raytool value put in."""
    raw, pop = r.raw, (lambda key, default=None: _pop(raw, key) if key in dict(leaves(raw)) else default)
    given = dict(leaves(raw))
    path, name = pop("custom_reward_function.path"), pop("custom_reward_function.name")
    if path:
        r.put(_both("custom_reward_function.path", "custom_reward_function.name" if name else ""), "reward.fn", f"{path}:{name or 'compute_score'}")
    elif name:
        r.refused.append("'custom_reward_function.name' without custom_reward_function.path: raytool's reward.fn names the file too (PATH:NAME)")
    mini = pop(f"{AR}.actor.ppo_mini_batch_size")
    if mini is not None:
        batch = given.get("data.train_batch_size", given.get("data.prompts_per_step", 4))
        if not isinstance(mini, int) or mini < 1 or batch % mini:
            r.refused.append(f"'{AR}.actor.ppo_mini_batch_size' ({mini}) must divide 'data.train_batch_size' ({batch}): "
                             "raytool takes algorithm.mini_batches, the optimizer steps per batch")
        else:
            r.put(f"{AR}.actor.ppo_mini_batch_size", "algorithm.mini_batches", batch // mini, f"{batch} / {mini}")
    for switch, coef, target in ((f"{AR}.actor.use_kl_loss", f"{AR}.actor.kl_loss_coef", "algorithm.kl_loss_coef"),
                                 ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_reward_coef")):
        on, value = pop(switch), pop(coef)
        if on is None and value is None:
            continue
        keys = _both(switch if on is not None else "", coef if value is not None else "")
        if not on:  # both of verl's switches default to False: a coefficient alone does nothing
            r.put(keys, target, 0.0, f"{switch} is False" + (f": {coef}={value} has no effect" if value else ""))
        else:
            r.put(keys, target, 0.001 if value is None else value, "" if value is not None else "verl's default kl_coef")
    kl_type = pop(f"{AR}.actor.kl_loss_type")
    if kl_type is not None:
        if kl_type in _KL_TYPES:
            r.put(f"{AR}.actor.kl_loss_type", "algorithm.kl_type", _KL_TYPES[kl_type])
        else:
            r.refused.append(f"'{AR}.actor.kl_loss_type' {kl_type!r}: raytool's algorithm.kl_type is k1 (kl), k2 (mse) or k3 (low_var_kl)")
    for key, target in (("trainer.save_freq", "trainer.save_every"), ("trainer.test_freq", "eval.every")):
        value = pop(key)
        if value is not None:
            r.put(key, target, 0 if value == -1 else value, "verl's -1: never" if value == -1 else "")
    users = pop(f"{AR}.rollout.multi_turn.max_user_turns")
    turns = given.get(f"{AR}.rollout.multi_turn.max_assistant_turns", given.get("agent.max_turns", 6))
    if users is not None:
        if isinstance(users, int) and users >= turns:
            r.accepted.append(f"{AR}.rollout.multi_turn.max_user_turns={users}: no fewer than the {turns} assistant turns, "
                              "so no limit (a tool turn follows an assistant turn)")
        else:
            r.refused.append(f"'{AR}.rollout.multi_turn.max_user_turns' ({users}) below max_assistant_turns ({turns}): raytool limits "
                             "the assistant turns only: set agent.max_turns")
    device = pop("trainer.device")
    if device is not None:
        if device in ("cuda", "npu"):
            r.put("trainer.device", "cluster.accelerator", "NPU" if device == "npu" else "GPU")
        else:
            r.refused.append(f"'trainer.device' {device!r}: raytool trains on cuda or npu accelerators (cluster.accelerator), or on CPUs without any")
    _prompt_length(r, pop)
    _reward_manager(r, pop)
    _custom_dataset(r, pop)
    if "trainer.total_training_steps" in given and "trainer.total_epochs" in given:  # verl: the steps win
        pop("trainer.total_epochs")
        r.accepted.append("trainer.total_epochs: trainer.total_training_steps is given too, and wins (as in verl)")


def _both(*keys: str) -> str:
    """The verl keys one raytool value came from, as the notice names them."""
    return " + ".join(k for k in keys if k)


def _prompt_length(r: Reading, pop) -> None:
    """verl's filter_overlong_prompts and truncation as raytool's data.overlong_prompts."""
    drop, cut = pop("data.filter_overlong_prompts"), pop("data.truncation")
    if drop:
        r.put("data.filter_overlong_prompts", "data.overlong_prompts", "drop")
        if cut is not None:
            r.accepted.append(f"data.truncation={cut!r}: data.filter_overlong_prompts leaves no prompt to cut")
    elif cut in (None, "error"):
        if drop is not None or cut is not None:
            r.put("data.truncation" if cut else "data.filter_overlong_prompts", "data.overlong_prompts", "error")
    else:
        r.refused.append(f"'data.truncation' {cut!r}: raytool renders each prompt from its messages and cannot cut it; "
                         "data.overlong_prompts is drop (verl's filter_overlong_prompts=True) or error")


def _reward_manager(r: Reading, pop) -> None:
    manager = pop("reward_model.reward_manager")
    enable = pop("reward_model.overlong_buffer.enable")
    length, factor = pop("reward_model.overlong_buffer.len"), pop("reward_model.overlong_buffer.penalty_factor")
    if pop("reward_model.overlong_buffer.log") is not None:
        r.accepted.append("reward_model.overlong_buffer.log: raytool logs the overlong penalty always (reward metrics)")
    if manager not in (None, "naive", "prime", "dapo"):
        r.refused.append(f"'reward_model.reward_manager' {manager!r}: raytool scores each trajectory as it finishes with reward.fn "
                         "(verl's naive, prime and dapo managers map; see docs/verl.md)")
        return
    if manager:
        r.accepted.append(f"reward_model.reward_manager={manager}: raytool scores each trajectory with reward.fn as it finishes"
                          + (" (DAPO's overlong shaping from reward_model.overlong_buffer.*)" if manager == "dapo" else ""))
    if enable:
        r.put(_both("reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len" if length is not None else ""),
              "reward.overlong_buffer_tokens", length if length is not None else 4096)
        if factor is not None:
            r.put("reward_model.overlong_buffer.penalty_factor", "reward.overlong_penalty_factor", factor)
    elif enable is False and (length is not None or factor is not None):
        r.accepted.append("reward_model.overlong_buffer.len / penalty_factor: overlong_buffer.enable is False")


def _custom_dataset(r: Reading, pop) -> None:
    path, name = pop("data.custom_cls.path"), pop("data.custom_cls.name")
    if path is None and name is None:
        return
    if str(path or "").endswith("retool/retool.py") and name == "CustomRLHFDataset":
        r.accepted.append(f"data.custom_cls.path + data.custom_cls.name={path}:{name}: ReTool's class rewrites DAPO-Math-17k's rows; raytool reads "
                          "the rows `raytool preprocess dapo_math_17k` writes, which are those (data.train_files must be its output)")
        return
    r.refused.append(f"'data.custom_cls' ({path}:{name}): raytool reads prompt rows, not a dataset class; write the rows your class "
                     "makes into a parquet file (docs/data.md gives the schema; `raytool preprocess` does it for the known data sets)")


def _gpus(r: Reading) -> None:
    """verl's trainer.nnodes x trainer.n_gpus_per_node as raytool's roles, where the config does
    not place them itself (trainer.num_gpus, rollout.num_gpus, or the counts of either)."""
    have = dict(leaves(r.raw))
    if not {"trainer.nnodes", "trainer.n_gpus_per_node"} & set(have):
        return
    placed = {"trainer.num_gpus", "rollout.num_gpus", "trainer.num_workers", "rollout.num_servers"} & set(have)
    nodes, per_node = have.get("trainer.nnodes", 1), have.get("trainer.n_gpus_per_node", 8)
    if placed:
        r.accepted.append(f"trainer.nnodes x trainer.n_gpus_per_node ({nodes} x {per_node}): the cluster; the config places the roles "
                          f"itself ({', '.join(sorted(placed))})")
        return
    tp = have.get(f"{AR}.rollout.tensor_model_parallel_size", have.get("rollout.tensor_parallel_size", 1))
    sp = have.get(f"{AR}.actor.ulysses_sequence_parallel_size", have.get("trainer.sequence_parallel_size", 1))
    if have.get(f"{AR}.model.lora_rank", have.get("trainer.lora_rank", 0)):  # raytool's LoRA trains on one rank
        trainers, servers, shared = 1, max(1, (nodes * per_node - 1) // tp), nodes * per_node == 1
        r.accepted.append(f"{GPUS}: LoRA trains on one rank in raytool: 1 GPU trains, the others serve")
    else:
        try:
            trainers, servers, shared = split_gpus(nodes * per_node, tp, sp)
        except VerlKeyError as exc:
            r.refused.append(str(exc))
            return
    share = 0.5 if shared else 1.0
    for key, value in (("trainer.num_workers", trainers), ("trainer.num_gpus", share), ("rollout.num_servers", servers),
                       ("rollout.num_gpus", tp * share)):
        r.put(GPUS, key, value, "the GPU split below")
    how = (f"trainer and rollout share every GPU (half each): too few GPUs for sequence parallel {sp} and separate servers" if shared
           else f"{trainers} GPUs train ({trainers // sp} data-parallel x SP {sp}), {servers * tp} serve ({servers} x TP {tp})")
    r.accepted.append(f"trainer.nnodes x trainer.n_gpus_per_node = {nodes * per_node} GPUs, which verl colocates; raytool gives the "
                      f"trainer and the rollout GPUs of their own: trainer.num_workers={trainers} trainer.num_gpus={share:g} "
                      f"rollout.num_servers={servers} rollout.num_gpus={tp * share:g}: {how}")
    if shared and have.get(f"{AR}.rollout.gpu_memory_utilization", have.get("rollout.gpu_memory_utilization", 0.9)) > 0.45:
        if f"{AR}.rollout.gpu_memory_utilization" in have:  # verl's own value is for a GPU the engine has to itself between phases
            _pop(r.raw, f"{AR}.rollout.gpu_memory_utilization")
        r.put(GPUS, "rollout.gpu_memory_utilization", 0.45, "a shared GPU")
        r.accepted.append("rollout.gpu_memory_utilization=0.45: a shared GPU keeps room for the trainer (verl frees the engine's memory "
                          "while it trains; raytool's engines stay up)")


def _always(path: str, table: dict[str, tuple[tuple | None, str]]) -> tuple[tuple | None, str] | None:
    """`path`'s entry in an ALWAYS-like table: its own, or a section's (`section.*`)."""
    return table.get(path) or next((v for k, v in table.items() if k.endswith(".*") and path.startswith(k[:-1])), None)


def _accept(r: Reading, path: str, value, entry: tuple[tuple | None, str]) -> None:
    values, does = entry
    _pop(r.raw, path)
    if values is None or value in values:
        r.accepted.append(f"{path}={value!r}: {does}")
    else:
        r.refused.append(f"'{path}' {value!r}: {does}; raytool cannot do otherwise")


def _read_sft(r: Reading) -> None:
    """verl's SFT trainer's own names (SFT_ALIASES, SFT_ALWAYS) read first: its data and optim keys are `raytool sft`'s."""
    for path, value in list(leaves(r.raw)):
        if path in SFT_ALIASES:
            value = _pop(r.raw, path)
            r.put(path, SFT_ALIASES[path], [value] if path.endswith("_files") and isinstance(value, str) else value)
        elif _always(path, SFT_ALWAYS):
            _accept(r, path, value, _always(path, SFT_ALWAYS))


def read(raw: dict, given: set[str], mine: set[str], sft: bool = False) -> Reading:
    """One pass over `raw` (a parsed config, overrides applied; `given`: the keys the command line
    set; `mine`: raytool's own keys, raytool.config.config_keys; `sft`: the keys are verl's SFT
    trainer's): verl's keys moved to raytool's in `raw`, what was accepted, what is refused."""
    present = dict(leaves(raw))
    known = verl_keys()
    r = Reading(raw, {k.lstrip("+") for k in given})
    if sft:
        _read_sft(r)
    elif not any(k in known or _always(k, ALWAYS) or k.split(".")[0] in VERL_ONLY_SECTIONS for k in present):
        return r  # raytool's own keys alone: nothing to read
    _gpus(r)
    derive(r)
    for path, value in list(leaves(raw)):
        if path in _LISTS and isinstance(value, str):
            _put(raw, path, [value])
            if path in ALIASES:
                r.put(path, ALIASES[path], _pop(raw, path))
        elif path in ALIASES:
            r.put(path, ALIASES[path], _pop(raw, path))
        elif _always(path, ALWAYS):
            _accept(r, path, value, _always(path, ALWAYS))
        elif path in NOT_APPLICABLE:
            _pop(raw, path)
            r.refused.append(f"'{path}': {NOT_APPLICABLE[path]}")
        elif not any(path == k or path.startswith(k + ".") for k in mine):
            section = path.split(".")[0]
            if section in VERL_ONLY_SECTIONS or section in ("data", "trainer", "algorithm"):
                _pop(raw, path)
                near_verl, near_mine = _nearest(path, known), _nearest(path, mine)
                hint = "; ".join(x for x in (f"the nearest verl key raytool reads: {near_verl}" if near_verl else "",
                                             f"the nearest raytool key: {near_mine}" if near_mine else "") if x)
                r.refused.append(f"'{path}' is not a key raytool knows, in verl's names or its own" + (f" ({hint})" if hint else ""))
    return r


def describe(r: Reading) -> list[str]:
    """The notice block's lines: each key read as raytool's, then each accepted."""
    return ([f"read as raytool's: {v} -> {t}={value!r}" + (f" ({note})" if note else "") for v, t, value, note in r.moved]
            + [f"accepted: {a}" for a in r.accepted])


def translate(raw: dict, given: set[str], mine: set[str]) -> dict:
    """`raw` with verl's keys read as raytool's, in one pass (`read`), the notice block logged.
    Raises VerlKeyError with every key it cannot take."""
    r = read(raw, given, mine)
    if r.refused:
        raise VerlKeyError(f"{len(r.refused)} verl key{'s' if len(r.refused) > 1 else ''} raytool cannot take (docs/verl.md):\n  "
                           + "\n  ".join(r.refused))
    if r.moved or r.accepted:
        log.info("verl keys: %d read as raytool's, %d accepted as what raytool does:\n  %s", len(r.moved), len(r.accepted),
                 "\n  ".join(describe(r)), extra=CONSOLE)  # the start shows it
    return r.raw


def steps_of_epochs(epochs: int, rows: int, batch: int) -> int:
    """verl's total_epochs as GRPO steps: whole batches per epoch (its loader drops the last partial one)."""
    return epochs * max(1, math.floor(rows / batch))
