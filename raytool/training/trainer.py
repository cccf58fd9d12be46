"""The trainer: one per device. fp32 master weights and AdamW state, bf16 compute on accelerators
(FSDP2 mixed precision), token-budget micro-batches, the RL step (GRPO/RLOO advantages, PPO-clip
with dual-clip, KL to a reference, entropy) and the SFT step, resumable checkpoints.

With several workers the model is sharded with FSDP2 over the already-initialized process group
and each rank trains on its own slice of the batch; every normalizer (token count, sequence
count) is global, so the update equals the single-process update on the whole batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from raytool.algos import get_adv_estimator, get_policy_loss, kl_penalty, masked_aggregate
from raytool.algos.correction import CORRECTION_METRICS, rollout_correction
from raytool.algos.datum_losses import get_datum_loss
from raytool.resolve import with_trainer_autos
from raytool.config import RunConfig, no_prefix_sharing
from raytool.distill import token_advantages
from raytool.errors import RaytoolError
from raytool.moe import RouterTap, covers, find_routers, load_imbalance, moe_classes_without_replay, replay_tensor, routes_array, split_recording, valid_tokens
from raytool.resolve import with_rollout_correction
from raytool import device as device_info
from raytool import storage
from raytool.training.export import HF_FILES, MAX_SHARD_BYTES, export_dtype, is_fused_moe, write_hf_to
from raytool.training.batching import layout, micro_batches, packed_micro_batches, pad_right, shared_prefix_units, to_device, tree_size
from raytool.training.model import DTYPES, PolicyModel, causal_sdpa, load_lm, load_sharded, merged_named_weights, single_process_quiet, trainable_state
from raytool.types import Datum, Routes, SFTExample, TrainBatch

log = logging.getLogger(__name__)


def lr_at(step: int, peak: float, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then constant or cosine
    decay to `min_ratio * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class NonFiniteWeights(RaytoolError):
    """The policy holds NaN or infinite weights: nothing is saved or exported from it."""


@dataclass
class _Seq:
    ids: list[int]
    mask: list[int]  # aligned with ids[1:]: 1 where the loss sees the token
    adv: float = 0.0
    rollout: list[float] | None = None  # engine log-probs, aligned like mask (0.0 where mask is 0)
    teacher: list[float] | None = None  # distill.teacher: the teacher's log-probs, aligned like mask (0.0 where mask is 0)
    old: list[float] | torch.Tensor | None = None  # log-probs before this update, when the update is not purely on-policy (on the device)
    ref: list[float] | torch.Tensor | None = None  # reference-policy log-probs, when a KL term is on (on the device)
    routes: np.ndarray | None = None  # MoE router replay: the experts of each position of ids, [len(ids), layers, k] (-1: the router's own)
    group: int | None = None  # its GRPO group in the batch (shared prefixes are trained once per group); None: a group of its own
    targets: list[int] | None = None  # a caller's own loss (Datum): what each position predicts, instead of the next token
    inputs: dict[str, list[float]] | None = None  # and its loss's per-position inputs

    def scored(self) -> list[int]:
        return [t for t, m in enumerate(self.mask) if m]


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype of `trainer.compute_dtype` on `device`. auto: bfloat16 on
    accelerators and on CPUs that compute bf16 natively (AVX512-BF16, AMX-BF16, Arm BF16), float32
    on other CPUs, where PyTorch emulates bf16 far slower than fp32. With several CPU ranks in a
    process group, auto is bf16 only if every rank's CPU has it (FSDP needs one dtype)."""
    if device.type != "cpu":
        return torch.bfloat16 if name == "auto" else DTYPES[name]
    if name not in ("auto", "bfloat16"):
        return DTYPES[name]
    native, why = device_info.cpu_bf16_support()
    if name == "auto":
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(native)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            native = bool(flag.item())
        chosen = torch.bfloat16 if native else torch.float32
        log.info("trainer.compute_dtype auto: %s (%s)", str(chosen).removeprefix("torch."), why)
        return chosen
    if name == "bfloat16" and not native:
        log.warning("config key 'trainer.compute_dtype' is bfloat16, but this CPU has no native bf16 (%s): PyTorch "
                    "emulates it, many times slower than float32 (auto would pick float32 here)", why)
    return DTYPES[name]


def check_4bit(device: torch.device) -> None:
    """trainer.load_in_4bit's device rule: bitsandbytes NF4 training is for CUDA GPUs."""
    import importlib.util

    if device.type != "cuda":
        raise ValueError(f"config key 'trainer.load_in_4bit' needs a CUDA GPU (bitsandbytes NF4); this trainer runs on {device.type}: set it false")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("config key 'trainer.load_in_4bit' needs bitsandbytes: pip install 'raytool[qlora]', or set it false")


def check_kernels(device: torch.device, model_path: str) -> None:
    """trainer.kernels' rules, before the model loads: Liger-Kernel's Triton kernels run on CUDA
    GPUs, where it is installed, for the model families it has kernels for."""
    import importlib.util

    if device.type != "cuda":
        raise ValueError(f"config key 'trainer.kernels' needs a CUDA GPU (Liger-Kernel's Triton kernels); this trainer runs on {device.type}: set it false or auto")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("config key 'trainer.kernels' needs Liger-Kernel: pip install 'raytool[gpu]', or set it false or auto")
    from transformers import AutoConfig

    from raytool.training.model import liger_supported

    model_type = AutoConfig.from_pretrained(model_path).model_type
    if not liger_supported(model_type):
        raise ValueError(f"config key 'trainer.kernels': Liger-Kernel has no kernels for model type {model_type!r} ({model_path}): set it false or auto")


def _init_single_process_group(backend: str) -> None:
    """FSDP2 (mixed precision, offload) needs a process group even with one worker. Its store is
    in-process: a TCP port picked free and bound later can be taken in between by another process."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class Trainer:
    def __init__(self, cfg: RunConfig, model_path: str, *, device: str = "cpu", rank: int = 0, world_size: int = 1):
        torch.manual_seed(cfg.trainer.seed)
        self.device = torch.device(device)
        cfg = with_trainer_autos(cfg, model_path, self.device.type != "cpu", device_info.accelerator_memory(self.device), log_notes=rank == 0)
        t = cfg.trainer
        self.cfg, self.model_path = cfg, model_path
        self.rank, self.world_size = rank, world_size
        self.dtype = compute_dtype(t.compute_dtype, self.device)
        # Metric sums and the KL reward term on the device: float64, but float32 on an NPU, whose
        # cores compute no float64 (torch_npu runs it on the AI CPU, if at all) and whose HCCL
        # reductions of it are not the fast path.
        self.sum_dtype = torch.float32 if self.device.type == "npu" else torch.float64
        if t.cpu_offload and self.device.type == "cpu":
            raise ValueError("config key 'trainer.cpu_offload' offloads accelerator memory to the host; on a CPU the weights already are there: set it false")
        if t.load_in_4bit:
            check_4bit(self.device)
        if t.compile and self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"config key 'trainer.compile': inductor compiles for CUDA GPUs and CPUs, not {self.device.type}: set it false")
        if t.kernels:
            check_kernels(self.device, model_path)
        self.packed = t.packing is True or (t.packing == "auto" and cfg.model.attn_implementation.startswith("flash_attention"))
        # A 4-bit base is not FSDP-sharded: its packed uint8 weights can be neither split by rows
        # nor cast by mixed precision (QLoRA runs on one worker, like all LoRA here).
        self.sharded = not t.load_in_4bit and (world_size > 1 or self.dtype != torch.float32 or t.cpu_offload)
        self.sp_group, self.dp_group, self.dp_size = self._sequence_parallel_groups(t.sequence_parallel_size)
        self.policy = self._load(activation_checkpointing=t.activation_checkpointing, lora_rank=t.lora_rank, lora_alpha=t.lora_alpha,
                                 lora_target_modules=list(t.lora_target_modules))
        self.lm = self.policy.lm
        self.pad_id = self.lm.config.pad_token_id or 0
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self.rollout_is = with_rollout_correction(cfg).algorithm.rollout_correction.rollout_is  # auto decided (raytool.resolve)
        self.reference: PolicyModel | None = None  # built on first use (KL on); LoRA uses the base model instead
        self.step = 0  # optimizer steps taken
        self.skipped_updates = 0  # optimizer steps skipped for a non-finite gradient norm (this process's life)
        self.rl_updates = 0  # optimizer steps of the RL phase (drive its learning-rate schedule)
        self.router_tap = self._router_tap()  # MoE models: expert load, and router replay when on
        self.prefix_sharing = self._prefix_sharing()  # "always", "saving" (auto: where it saves tokens) or ""

    def _router_tap(self) -> RouterTap | None:
        t = self.cfg.trainer
        if not find_routers(self.lm):
            if t.router_aux_loss_coef > 0:
                raise ValueError(f"config key 'trainer.router_aux_loss_coef' is {t.router_aux_loss_coef}, but {self.model_path} has no router "
                                 "raytool can balance (a dense model, or an MoE family it does not tap): set it 0")
            if t.router_replay != "off":
                others = moe_classes_without_replay(self.lm)
                raise ValueError(f"config key 'trainer.router_replay' is {t.router_replay}, but {self.model_path} " + (
                    f"routes with {', '.join(others)}, which raytool cannot replay yet (it replays the softmax top-k routers of "
                    "Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral): set it off" if others else "is a dense model, with no experts to route: set it off"))
            return None
        if t.router_replay == "r2" and self.cfg.algorithm.ppo_epochs == 1 and self.cfg.algorithm.mini_batches == 1 and self.rank == 0:
            log.info("trainer.router_replay=r2 with one update per batch: the update's forward is the old policy's own, so there is "
                     "nothing to replay (r2 replays it in the later updates of algorithm.ppo_epochs / mini_batches > 1)")
        return RouterTap(self.lm)

    def _prefix_sharing(self) -> str:
        """trainer.prefix_sharing for this model and layout: "always" (true), "saving" (auto, where a
        micro-batch's trees are smaller than its padded rows) or "" (off)."""
        setting = self.cfg.trainer.prefix_sharing
        why = no_prefix_sharing(self.cfg) or (self.packed and "trainer.packing runs a varlen kernel, which takes no tree mask") or (
            self.router_tap is not None and f"{self.model_path} is a mixture-of-experts model, whose router statistics count sequence positions")
        if setting is True and why:
            raise ValueError(f"config key 'trainer.prefix_sharing' is true, but {why}: set it auto or false")
        if setting is False or why:
            return ""
        return "always" if setting is True else "saving"

    @contextlib.contextmanager
    def _routing(self, group: list[_Seq], counting: bool = False):
        """The policy's routers use `group`'s routes (r2/r3; -1 and sequences without routes: their
        own) through the forward and the backward's recomputation; `counting` adds the forward's
        expert loads and replay disagreements to the step's counts."""
        tap = self.router_tap
        if tap is None:
            yield
            return
        lengths = [len(x.ids) for x in group]
        if any(x.routes is not None for x in group):
            tap.replay = to_device(replay_tensor([x.routes for x in group], lengths, self.packed, tap.top_k, tap.num_layers), self.device)
        tap.valid = to_device(torch.from_numpy(valid_tokens(lengths, self.packed)), self.device)
        tap.counting = counting
        tap.balancing = counting and self.cfg.trainer.router_aux_loss_coef > 0
        try:
            yield
        finally:
            tap.replay, tap.valid, tap.counting, tap.balancing, tap.kept = None, None, False, False, []

    def _sequence_parallel_groups(self, sp: int):
        """(SP group or None, data-parallel group, its size). Ranks r and r' share sequences when
        r // sp == r' // sp; the batch is split over the sp-th ranks (the data-parallel group of
        ranks with the same r % sp), and every batch-level sum runs over that group alone."""
        if sp == 1:
            return None, None, self.world_size
        from transformers import AutoConfig

        from raytool.training import sequence_parallel

        sequence_parallel.check_heads(AutoConfig.from_pretrained(self.model_path).num_attention_heads, sp)
        if not dist.is_initialized() or self.world_size % sp:
            raise ValueError(f"config key 'trainer.sequence_parallel_size' is {sp}: it needs a process group of a multiple of {sp} ranks")
        sequence_parallel.register_attention()
        # every rank creates every group, in the same order
        sp_group, _ = dist.new_subgroups_by_enumeration([list(range(first, first + sp)) for first in range(0, self.world_size, sp)])
        dp_group, _ = dist.new_subgroups_by_enumeration([list(range(offset, self.world_size, sp)) for offset in range(sp)])
        return sp_group, dp_group, self.world_size // sp

    def _load(self, **lm_options) -> PolicyModel:
        """The model at `model_path`, on the device. Sharded: rank 0 alone reads it and FSDP2 moves
        one layer at a time (the fp32 model is never whole on the accelerator, nor on any other
        rank's host); otherwise loaded and moved as a whole."""
        if self.sp_group is not None:
            from raytool.training.sequence_parallel import ATTENTION

            lm_options["attn_implementation"] = ATTENTION
        elif self.cfg.model.attn_implementation == "sdpa" and not self.packed:
            lm_options["attn_implementation"] = causal_sdpa()
        else:
            lm_options["attn_implementation"] = self.cfg.model.attn_implementation
        if self.cfg.trainer.load_in_4bit:
            policy = PolicyModel(load_lm(self.model_path, quantized_4bit=(self.dtype, self.device), **lm_options))
        elif not self.sharded:
            policy = PolicyModel(load_lm(self.model_path, **lm_options)).to(self.device)
        else:
            if not dist.is_initialized():
                _init_single_process_group(device_info.process_group_backend(self.device.type))
            policy = load_sharded(self.model_path, self.dtype, self.cfg.trainer.cpu_offload, self.device, sp_group=self.sp_group, **lm_options)
        if self.cfg.trainer.kernels:
            policy.use_fused_kernels()
        policy.set_compiled(self.cfg.trainer.compile)
        return policy

    # -- log-probs ---------------------------------------------------------------------------------

    def _plan(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        return self._plans([seqs])[0]

    def _plans(self, batches: list[list[_Seq]]) -> list[list[list[_Seq]]]:
        """Token-budget micro-batches of each of `batches`. Under FSDP every forward/backward is a
        collective, so every rank runs as many micro-batches as the busiest one: the others add a
        dummy whose mask is all 0 (it contributes exactly nothing to the loss or the gradients).
        All batches' counts agree in one all-reduce (one read back from the device)."""
        plans = [self._micro_batches(seqs) for seqs in batches]
        if self.world_size > 1:
            counts = torch.tensor([len(groups) for groups in plans], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            dummy = _Seq(ids=[self.pad_id, self.pad_id], mask=[0], rollout=[0.0], old=[0.0], ref=[0.0])
            for groups, count in zip(plans, counts.tolist()):
                groups += [[dummy]] * (count - len(groups))
        return plans

    def _micro_batches(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        """`seqs` in micro-batches of at most trainer.micro_batch_tokens: padded rows, packed rows,
        or, sharing prefixes, each group's trees (their size, not their sequences', is what counts)."""
        budget = self.cfg.trainer.micro_batch_tokens
        if not self.prefix_sharing:
            split = packed_micro_batches if self.packed else micro_batches
            return [[seqs[i] for i in g] for g in split([len(x.ids) for x in seqs], budget)]
        units = shared_prefix_units([x.ids for x in seqs], [x.group for x in seqs], budget)
        sizes = [tree_size([seqs[i].ids for i in unit]) for unit in units]
        return [[seqs[i] for u in g for i in units[u]] for g in micro_batches(sizes, budget)]

    def _trees(self, group: list[_Seq]) -> list[list[int]] | None:
        """The rows of `group`'s shared-prefix layout (the indices of each group's sequences), or
        None for one row per sequence: sharing is off, or (auto) its rows hold no fewer tokens."""
        if not self.prefix_sharing:
            return None
        rows: dict = {}
        for i, x in enumerate(group):
            rows.setdefault(i if x.group is None else ("g", x.group), []).append(i)
        trees = list(rows.values())
        if self.prefix_sharing == "saving":
            widest = max(tree_size([group[i].ids for i in tree]) for tree in trees)
            if len(trees) * widest >= len(group) * max(len(x.ids) for x in group):
                return None
        return trees

    def _row_tokens(self, group: list[_Seq]) -> tuple[int, int]:
        """The tokens a forward of `group` runs -> (as it runs: its rows times their width, padding
        and each shared prefix once included, or its sequences end to end when packed; with one
        row per sequence)."""
        if self.packed:
            end_to_end = sum(len(x.ids) for x in group)
            return end_to_end, end_to_end
        apart = len(group) * max(len(x.ids) for x in group)
        trees = self._trees(group)
        return (apart if trees is None else len(trees) * max(tree_size([group[i].ids for i in tree]) for tree in trees)), apart

    def _logprobs(self, model: PolicyModel, group: list[_Seq], *, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
        """Log-probs (and entropies) of the scored tokens of `group`, as [B, W] grids."""
        targets = [x.targets for x in group] if any(x.targets is not None for x in group) else None
        lay = layout([x.ids for x in group], [x.scored() for x in group], self.pad_id, self.packed, self.device, trees=self._trees(group),
                     targets=targets)
        logp, ent = model(lay.input_ids, lay.select, lay.labels, position_ids=lay.position_ids, temperature=temperature,
                          chunk_tokens=self.cfg.trainer.logprob_chunk_tokens, with_entropy=with_entropy, entropy_grad=entropy_grad,
                          varlen=lay.varlen_kwargs(), attention_mask=lay.attention_mask)
        return lay.to_grid(logp), (lay.to_grid(ent) if ent is not None else None)

    def _grid(self, group: list[_Seq], field: str, width: int) -> torch.Tensor:
        """`field` of each sequence of `group` as a [B, width] float32 grid on the device (0-padded).
        Host lists travel in one non-blocking copy; rows `_fill` left on the device stay there."""
        rows = [getattr(x, field) for x in group]
        if any(isinstance(r, torch.Tensor) for r in rows):
            rows = [r if isinstance(r, torch.Tensor) else to_device(torch.tensor(r, dtype=torch.float32), self.device) for r in rows]
            return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)[:, :width]
        return to_device(pad_right(rows, 0.0, torch.float32)[:, :width], self.device)

    @torch.no_grad()
    def _fill(self, seqs: list[_Seq], field: str, model: PolicyModel) -> None:
        """Store `model`'s log-probs of each sequence's scored tokens in `seq.<field>`, on the
        device (read back to the host they would cost a synchronisation per micro-batch)."""
        record = model is self.policy and field == "old" and self.cfg.trainer.router_replay == "r2"
        for group in self._plan(seqs):
            with self._routing(group) if model is self.policy else contextlib.nullcontext():
                if record:
                    self.router_tap.start_recording()
                grid, _ = self._logprobs(model, group, temperature=self.cfg.rollout.temperature)
                if record:  # r2: the old policy's routing, replayed in this batch's updates
                    recorded = split_recording(self.router_tap.stop_recording(), [len(x.ids) for x in group], self.packed)
                    for x, routes in zip(group, recorded):
                        x.routes = routes
            grid = grid.float()
            for row, x in enumerate(group):
                setattr(x, field, grid[row, : len(x.ids) - 1])

    def _reference(self) -> torch.nn.Module:
        """The KL reference: the weights the run started from, or those `start_rl` froze.
        With LoRA it is the base model (the adapters switched off), which costs no memory."""
        if self.reference is None:
            if self.cfg.trainer.lora_rank:
                self.reference = _AdaptersOff(self.policy)
            else:
                self.reference = self._load(activation_checkpointing=False)
                self.reference.requires_grad_(False)
        return self.reference

    def start_rl(self, *, snapshot_reference: bool) -> None:
        """After the in-run SFT warm-up: GRPO starts from a fresh AdamW state unless
        trainer.fresh_rl_optimizer is false (SFT's momentum and second moments would otherwise
        steer and scale the first RL updates), and with snapshot_reference the current weights
        become the KL reference (the cold-started policy is what RL should stay close to; a no-op
        with LoRA, whose reference is the base model)."""
        if self.cfg.trainer.fresh_rl_optimizer:
            self.optimizer = self._new_optimizer()
        if not snapshot_reference:
            return
        reference = self._reference()
        if isinstance(reference, PolicyModel):
            with torch.no_grad():
                for ref, p in zip(reference.parameters(), self.policy.parameters()):
                    ref.copy_(p.detach())

    # -- the optimizer -------------------------------------------------------------------------------

    def _global_sums(self, values: list[float]) -> list[float]:
        """Each value summed over the data-parallel ranks, in one all-reduce: host numbers, reduced
        in float64 on the host (gloo: the process group's CPU backend on every device)."""
        if self.dp_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params, lr=self.cfg.trainer.lr, weight_decay=self.cfg.trainer.weight_decay)

    def _optimizer_step(self, lr: float, clip: float | None = None) -> torch.Tensor:
        """Clip (to `clip`, default trainer.grad_clip; inf: measure only), step, zero the gradients;
        returns the gradient norm before clipping, on the device (reading it back would wait for the
        step: the caller reads it once, at the end)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for p in self.params:  # a step with no gradient still moves AdamW's moments: keep it
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.trainer.grad_clip if clip is None else clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):  # a non-finite loss or gradient (the same norm on every rank): skip, as verl does
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return grad_norm.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm.detach()

    def _rl_lr(self) -> float:
        t, a = self.cfg.trainer, self.cfg.algorithm
        return lr_at(self.rl_updates, t.lr, t.warmup_steps, t.total_steps * a.ppo_epochs * a.mini_batches, t.lr_schedule, t.min_lr_ratio)

    # -- RL ------------------------------------------------------------------------------------------

    def rl_step(self, batch: TrainBatch) -> dict:
        """One policy update on this rank's part of a batch; returns metrics (the same on every rank).

        `batch.sequences` are this rank's own; its rewards, groups and `trained` are the whole
        batch's (all ranks). One process: `TrainBatch.whole(trajectories)`. A trajectory not trained
        (stopped by its wall-clock limit: raytool.types.trained) counts in neither its group's
        advantage statistics nor the loss.

        Its phases, top to bottom: every collective is in this body, in the same order on every
        rank, each decision before one made on what every rank holds alike (the config, the whole
        batch's rewards, an all-reduced value); forwards and backwards (FSDP's collectives) run the
        same number of micro-batches on every rank (`_plans`)."""
        a = self.cfg.algorithm
        on_policy = a.ppo_epochs == 1 and a.mini_batches == 1  # the policy cannot change between the old log-probs and the update
        start = time.perf_counter()
        batch_rewards, batch_groups, batch_trained = batch.rewards, batch.groups, batch.trained
        index, seqs, route_counts = self._own_sequences(batch)

        # 1. The reference's and the old policy's log-probs (forwards).
        if self.router_tap is not None:
            self.router_tap.reset_counts()
        if a.kl_on:
            self._fill(seqs, "ref", self._reference())
        if not on_policy or a.kl_reward_coef > 0:
            self._fill(seqs, "old", self.policy)

        # 2. Rewards and advantages: a non-finite one skips the update on every rank alike.
        rewards = torch.tensor(batch_rewards, dtype=torch.float32)
        if not torch.isfinite(rewards[torch.tensor(batch_trained, dtype=torch.bool)]).all():  # the whole batch's: every rank's view
            return self._skipped("reward", time.perf_counter() - start)
        metrics: dict[str, float] = {}
        if a.kl_reward_coef > 0:  # r_i - beta * sum_t KL_t, the KL summed over each sequence's tokens
            kl = self._own_reward_kl(seqs, index, len(batch_rewards))
            if self.dp_size > 1:
                dist.all_reduce(kl, group=self.dp_group)  # collective: every rank's sequences' KL
            rewards = rewards - a.kl_reward_coef * kl.cpu().float()
            metrics["actor/reward_kl_penalty"] = float(kl.mean())
        adv, kept = self._advantages(rewards, batch_groups, batch_trained)
        if not torch.isfinite(adv).all():  # e.g. a reward KL penalty gone non-finite: all-reduced, so every rank's view
            return self._skipped("advantage", time.perf_counter() - start)
        for i, x in zip(index, seqs):
            x.adv = float(adv[i])

        # 3. Mini-batches, their loss normalizers and the batch's counts (one all-reduce), their micro-batch plans.
        minis, active, skip_zero_adv = self._mini_batches(seqs)
        counts = self._global_sums([v for mini in minis for v in (sum(sum(x.mask) for x in mini), len(mini))] + route_counts + [len(active), len(seqs)])
        plans = self._plans([[x for x in mini if id(x) in active] if skip_zero_adv else mini for mini in minis])

        # 4. The updates: one optimizer step per mini-batch (forwards, backwards, FSDP's reductions).
        sums: dict[str, torch.Tensor] = {}  # metric -> token-weighted sum, then its weight
        if route_counts:  # every rank: the diagnostics' forwards are collectives under FSDP
            first = self._plan(seqs)
            if first:
                self._replay_diagnostics(first[0], sums)
        tokens, computed, unshared, grad_norms, skipped_before, lr = 0, 0, 0, [], self.skipped_updates, self._rl_lr()
        for k, plan in enumerate(plans):
            n_tokens, n_seqs = max(counts[2 * k], 1.0), max(counts[2 * k + 1], 1.0)
            lr = self._rl_lr()
            for group in plan:
                tokens += sum(len(x.ids) for x in group)
                ran, apart = self._row_tokens(group)
                computed, unshared = computed + ran, unshared + apart
                self._rl_micro_step(group, on_policy, n_tokens, n_seqs, sums)
            grad_norms.append(self._optimizer_step(lr))
            self.rl_updates += 1

        # 5. Metrics: the declared names reduced in one all-reduce, then the token count.
        self._routing_metrics(sums)
        out = {**self._reduce_metrics(sums), **metrics}
        tokens, computed, unshared = self._global_sums([tokens, computed, unshared])
        elapsed = time.perf_counter() - start
        self._note_compile_time(len(grad_norms), elapsed)
        if route_counts:  # the rest had no (complete) engine routes: trained on their own routing
            out["router/replayed_seq_frac"] = counts[2 * len(minis)] / max(counts[2 * len(minis) + 1], 1.0)
        return out | {"actor/grad_norm": float(torch.stack(grad_norms).to(self.sum_dtype).mean()), "actor/lr": lr,
                      "adv/abs_mean": adv[kept].abs().mean().item() if kept else 0.0, "actor/skipped_seq_frac": 1.0 - counts[-2] / max(counts[-1], 1.0),
                      "perf/train_tokens_per_s": tokens / max(elapsed, 1e-9), "perf/update_tokens": tokens, "perf/update_row_tokens": computed,
                      "perf/update_row_tokens_unshared": unshared,
                      "actor/skipped_updates": float(self.skipped_updates - skipped_before)}

    def _own_sequences(self, batch: TrainBatch) -> tuple[list[int], list[_Seq], list[float]]:
        """This rank's trained sequences -> (their places in the batch, the sequences, r3's
        [replayed, total] counts or [])."""
        own = [(i, x) for i, x in zip(batch.index, batch.sequences) if batch.trained[i]]  # the rest: no forward, no loss
        seqs = [_Seq(ids=x.ids, mask=x.mask, rollout=x.logprobs, teacher=x.teacher, group=batch.groups[i]) for i, x in own]
        if self.cfg.distill.teacher and any(x.teacher is None for x in seqs):  # the agent worker infra-fails a trajectory the teacher did not score
            raise ValueError(f"rank {self.rank}: distill.teacher is set but {sum(x.teacher is None for x in seqs)} trained sequences have no teacher log-probs")
        route_counts = self._engine_routes(seqs, [x.routes for _, x in own]) if self.cfg.trainer.router_replay == "r3" else []
        return [i for i, _ in own], seqs, route_counts

    def _own_reward_kl(self, seqs: list[_Seq], index: list[int], batch: int) -> torch.Tensor:
        """[batch] the KL of this rank's sequences summed over their tokens, at their places (0 elsewhere)."""
        a = self.cfg.algorithm
        kl = torch.zeros(batch, dtype=self.sum_dtype, device=self.device)
        if seqs:  # [own sequences, tokens] grids, 0-padded (every KL estimator is 0 there)
            width = max(len(x.ids) for x in seqs) - 1
            per_seq = (kl_penalty(self._grid(seqs, "old", width), self._grid(seqs, "ref", width), a.kl_type) * self._grid(seqs, "mask", width)).sum(1)
            kl[to_device(torch.tensor(index), self.device)] = per_seq.to(self.sum_dtype)
        return kl

    def _mini_batches(self, seqs: list[_Seq]) -> tuple[list[list[_Seq]], set[int], bool]:
        """algorithm.ppo_epochs x mini_batches shuffled mini-batches of this rank's sequences -> (them,
        the ids of the sequences that change the loss, whether the others are skipped)."""
        a = self.cfg.algorithm
        skip_zero_adv = (getattr(get_policy_loss(a.policy_loss), "zero_advantage_is_noop", False) and not a.kl_on and a.entropy_coeff == 0
                         and not self.cfg.distill.teacher)  # distillation: every token has its own advantage
        active = {id(x) for x in seqs if x.adv != 0.0 or not skip_zero_adv}  # the rest would add exactly nothing
        orders = [torch.randperm(len(seqs)).tolist() for _ in range(a.ppo_epochs)]
        return [[seqs[i] for i in order[m :: a.mini_batches]] for order in orders for m in range(a.mini_batches)], active, skip_zero_adv

    def _skipped(self, what: str, elapsed: float) -> dict:
        """The metrics of an RL step whose update is skipped before any forward: a non-finite
        `what` (reward, advantage) in the batch, the same on every rank. The weights stay as they were."""
        self.skipped_updates += 1
        log.warning("rank %d: update skipped: a non-finite %s in the batch", self.rank, what)
        return {"actor/skipped_updates": 1.0, f"actor/nonfinite_{what}": 1.0, "actor/lr": self._rl_lr(), "perf/train_tokens_per_s": 0.0,
                "timing/skipped_s": elapsed}

    def _advantages(self, rewards: torch.Tensor, groups: list, trained: list[bool]) -> tuple[torch.Tensor, list[int]]:
        """The batch's advantages over its trained trajectories (0 for the rest) -> (advantages, their indices)."""
        a = self.cfg.algorithm
        kept = [i for i, k in enumerate(trained) if k]
        adv = torch.zeros_like(rewards)
        if kept:
            adv[kept] = get_adv_estimator(a.adv_estimator)(rewards[kept], [groups[i] for i in kept], norm_by_std=a.norm_adv_by_std)
        return adv, kept

    def _rl_micro_step(self, group: list[_Seq], on_policy: bool, n_tokens: float, n_seqs: float, sums: dict) -> None:
        with self._routing(group, counting=True):
            self._rl_micro_update(group, on_policy, n_tokens, n_seqs, sums)

    def _rl_micro_update(self, group: list[_Seq], on_policy: bool, n_tokens: float, n_seqs: float, sums: dict) -> None:
        a = self.cfg.algorithm
        logp, entropy = self._logprobs(self.policy, group, temperature=self.cfg.rollout.temperature, with_entropy=True,
                                       entropy_grad=a.entropy_coeff > 0)
        tap = self.router_tap
        if tap is not None:
            tap.counting = tap.balancing = False  # the backward's recomputation is not counted or kept again
        width = logp.size(1)
        mask = self._grid(group, "mask", width)
        rollout = self._grid(group, "rollout", width)  # the engine's (behaviour policy)
        prox = logp.detach() if on_policy else self._grid(group, "old", width)  # the trainer's before this update
        c = a.rollout_correction
        options = {}
        corrections = {}
        if self.rollout_is or c.rollout_rs:
            weights, mask, corrections = rollout_correction(prox, rollout, mask, rollout_is=self.rollout_is, is_threshold=c.rollout_is_threshold,
                                                            rollout_rs=c.rollout_rs, rs_upper=c.rollout_rs_threshold, rs_lower=c.rollout_rs_threshold_lower)
            if self.rollout_is:
                options["weights"] = weights
        adv = to_device(torch.tensor([x.adv for x in group]), self.device).unsqueeze(1).expand_as(logp)
        d = self.cfg.distill
        if d.teacher:  # on-policy distillation: each token's own advantage, the teacher's word on it (raytool.distill)
            adv, kl = token_advantages(adv, rollout, self._grid(group, "teacher", width), mask, d.kl_coef, d.reward_weight)
            corrections["distill/reverse_kl"] = kl.sum() / mask.sum().clamp(min=1.0)
        pg_loss, extra = get_policy_loss(a.policy_loss)(
            logp, prox if c.decoupled else rollout, adv, mask, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            agg=a.loss_agg, num_tokens=n_tokens, num_seqs=n_seqs, **options,
        )
        extra.update(corrections)
        loss = pg_loss
        with torch.no_grad():
            extra["rollout/logprob_abs_diff"] = ((logp.detach() - rollout).abs() * mask).sum() / mask.sum().clamp(min=1.0)
            extra["actor/entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0)
        if a.kl_loss_coef > 0:
            kl = kl_penalty(logp, self._grid(group, "ref", width), a.kl_type)
            loss = loss + a.kl_loss_coef * masked_aggregate(kl, mask, a.loss_agg, n_tokens, n_seqs)
            extra["actor/kl_loss"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1.0)
        if a.entropy_coeff > 0:
            loss = loss - a.entropy_coeff * masked_aggregate(entropy, mask, a.loss_agg, n_tokens, n_seqs)
        coef = self.cfg.trainer.router_aux_loss_coef
        if coef > 0:  # this micro-batch's share of the mini-batch's trained tokens, like the policy loss
            balance = tap.balance_loss()
            loss = loss + coef * balance * mask.sum() / n_tokens
            extra["moe/aux_loss"] = balance.detach()
        # FSDP averages gradients over ranks; the global normalizers already divide by the whole
        # mini-batch, so undo that average.
        (loss * self.world_size).backward()
        weight = mask.sum()
        for k, v in extra.items():
            acc = sums.setdefault(k, torch.zeros(2, dtype=self.sum_dtype, device=self.device))
            acc += torch.stack([torch.as_tensor(v, dtype=self.sum_dtype, device=self.device) * weight, weight.to(self.sum_dtype)])
        acc = sums.setdefault("actor/pg_loss", torch.zeros(2, dtype=self.sum_dtype, device=self.device))
        acc += torch.stack([pg_loss.detach().to(self.sum_dtype), torch.ones((), dtype=self.sum_dtype, device=self.device)])

    def _engine_routes(self, seqs: list[_Seq], engine: list[Routes | None]) -> list[float]:
        """r3: each sequence's engine routes, where they are complete and of this model's shape (the
        others train on their own routing, never on misaligned routes); returns [replayed, total]."""
        tap = self.router_tap
        shapes = set()
        for x, given in zip(seqs, engine):
            routes = routes_array(given, len(x.ids), tap.num_layers, tap.top_k)
            if given is not None and routes is None:
                shapes.add((given.layers, given.top_k))
            x.routes = routes if routes is not None and covers(routes, x.scored()) else None
        if shapes:
            log.warning("router replay: routes of %s (layers, experts per token) for a model of %s: those trajectories train without replay",
                        sorted(shapes), (tap.num_layers, tap.top_k))
        return [float(sum(x.routes is not None for x in seqs)), float(len(seqs))]

    @torch.no_grad()
    def _replay_diagnostics(self, group: list[_Seq], sums: dict) -> None:
        """r3's evidence on one micro-batch per step (also when no sequence of the step is trained):
        how far the trainer's log-probs are from the engine's routing on its own and replaying the
        engine's routes, and how many routes replay changed."""
        for name, replay in (("router/logprob_abs_diff_without_replay", False), ("router/logprob_abs_diff_with_replay", True)):
            with self._routing(group, counting=True) if replay else contextlib.nullcontext():
                logp, _ = self._logprobs(self.policy, group, temperature=self.cfg.rollout.temperature)
            width = logp.size(1)
            mask, rollout = self._grid(group, "mask", width), self._grid(group, "rollout", width)
            acc = sums.setdefault(name, torch.zeros(2, dtype=self.sum_dtype, device=self.device))
            acc += torch.stack([((logp.float() - rollout).abs() * mask).sum().to(self.sum_dtype), mask.sum().to(self.sum_dtype)])

    def _routing_metrics(self, sums: dict) -> None:
        """The step's expert load (busiest over mean expert, per layer) and, when replaying, the share
        of (token, layer) routes where the trainer's own top-k differed from the replayed one."""
        tap = self.router_tap
        if tap is None:
            return
        if tap.load is not None:
            sums["moe/load_imbalance"] = torch.tensor([load_imbalance(tap.load), 1.0], dtype=self.sum_dtype, device=self.device)
        if tap.compared is not None:
            sums["router/replay_differs_frac"] = torch.stack([tap.differs.to(self.sum_dtype), tap.compared.to(self.sum_dtype)]).to(self.device)
        elif self.cfg.trainer.router_replay != "off" and self.world_size > 1:  # every rank reduces the same names
            sums["router/replay_differs_frac"] = torch.zeros(2, dtype=self.sum_dtype, device=self.device)

    def _metric_names(self) -> tuple[str, ...]:
        """The names an RL step's micro-batches may report, declared by the config alone (the same
        on every rank), in the order they are reduced in."""
        a, t = self.cfg.algorithm, self.cfg.trainer
        names = ["actor/pg_loss", "rollout/logprob_abs_diff", "actor/entropy", *getattr(get_policy_loss(a.policy_loss), "metric_names", ())]
        if self.rollout_is or a.rollout_correction.rollout_rs:
            names += CORRECTION_METRICS
        if a.kl_loss_coef > 0:
            names.append("actor/kl_loss")
        if self.cfg.distill.teacher:
            names.append("distill/reverse_kl")
        if t.router_aux_loss_coef > 0:
            names.append("moe/aux_loss")
        if self.router_tap is not None:
            names += ["moe/load_imbalance"] + (["router/replay_differs_frac"] if t.router_replay != "off" else [])
            if t.router_replay == "r3":
                names += ["router/logprob_abs_diff_without_replay", "router/logprob_abs_diff_with_replay"]
        return tuple(names)

    def _reduce_metrics(self, sums: dict) -> dict:
        """Token-weighted means over every micro-batch of every rank (pg_loss: summed per optimizer
        step, since each micro-batch holds its share of the mini-batch's loss), in one all-reduce of
        the declared names (`_metric_names`): a rank without a value for one sends zeros, so every
        rank's tensor has the same shape whatever its data; a name reported by no rank is left out."""
        names = self._metric_names()
        undeclared = sorted(set(sums) - set(names))
        if undeclared:
            raise ValueError(f"the RL step reported metrics it does not declare: {undeclared} (algorithm.policy_loss "
                             f"{self.cfg.algorithm.policy_loss!r}: list them in its `metric_names`)")
        zero = torch.zeros(2, dtype=self.sum_dtype, device=self.device)
        stacked = torch.stack([torch.cat([sums.get(n, zero), torch.ones(1, dtype=self.sum_dtype, device=self.device) * (n in sums)]) for n in names])
        if self.dp_size > 1:
            dist.all_reduce(stacked, group=self.dp_group)
        out = {n: float(v[0] / v[1].clamp(min=1e-12)) for n, v in zip(names, stacked) if v[2] > 0}
        if "actor/pg_loss" in out:
            a = self.cfg.algorithm
            out["actor/pg_loss"] = float(stacked[names.index("actor/pg_loss")][0]) / (a.ppo_epochs * a.mini_batches)
        return out

    # -- SFT -----------------------------------------------------------------------------------------

    def sft_loss(self, examples: list[SFTExample], *, train: bool) -> tuple[float, float]:
        """Token-mean cross-entropy where loss_mask is 1 over `examples` (this rank's slice); with
        train=True the gradients are accumulated. Returns (global loss, global token count)."""
        seqs = [_Seq(ids=e.input_ids, mask=e.loss_mask[1:]) for e in examples]
        n_tokens = max(self._global_sums([sum(sum(s.mask) for s in seqs)])[0], 1.0)
        total = torch.zeros((), dtype=self.sum_dtype, device=self.device)
        with torch.set_grad_enabled(train):
            for group in self._plan(seqs):
                logp, _ = self._logprobs(self.policy, group, temperature=1.0)
                mask = self._grid(group, "mask", logp.size(1))
                loss = masked_aggregate(-logp, mask, "token-mean", n_tokens)
                if train:
                    (loss * self.world_size).backward()
                total += loss.detach().to(self.sum_dtype)
        return self._global_sums([float(total)])[0], n_tokens

    def _note_compile_time(self, optimizer_steps: int, elapsed: float) -> None:
        """Once: how long the trainer's first step (`optimizer_steps` optimizer steps) took while compiling."""
        if self.cfg.trainer.compile and self.rank == 0 and self.step == optimizer_steps:
            log.info("trainer.compile: the first step took %.1f s, compiling included (later steps reuse the compiled code)", elapsed)

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        """One supervised step on this rank's slice of a batch."""
        start = time.perf_counter()
        loss, n_tokens = self.sft_loss(examples, train=True)
        skipped = self.skipped_updates
        grad_norm = self._optimizer_step(lr)
        self._note_compile_time(1, time.perf_counter() - start)
        return {"sft/loss": loss, "sft/grad_norm": float(grad_norm), "sft/lr": lr, "sft/tokens": n_tokens,
                "sft/skipped_updates": float(self.skipped_updates - skipped)}

    @torch.no_grad()
    def sft_val_loss(self, examples: list[SFTExample]) -> float:
        return self.sft_loss(examples, train=False)[0]

    # -- a caller's own loss (the Tinker API: raytool.tinker) ---------------------------------------------

    def forward_backward(self, datums: list[Datum], loss: str, config: dict | None = None, *, backward: bool = True) -> tuple[list[list[float]], dict]:
        """The policy's log-prob of each datum's targets and, with `backward`, the gradients of loss
        `loss` (raytool.algos.datum_losses, a sum over positions) added to those of earlier calls:
        they add up until `optim_step`. Returns (each datum's log-probs, {"loss:sum": the loss, and
        "<name>:mean" for each of the loss's own metrics, averaged over micro-batches}). One process
        (LoRA or full weights)."""
        if self.world_size > 1:
            raise RuntimeError("forward_backward runs on one trainer process (the Tinker service's trainer), not on an FSDP group")
        fn = get_datum_loss(loss)
        options = {**fn.config, **(config or {})}
        # one group: the datums' shared prefixes (a GRPO group's prompt) are run once where that saves tokens (trainer.prefix_sharing)
        seqs = [_Seq(ids=list(d.tokens) + [d.targets[-1]], mask=[1] * len(d.targets), targets=list(d.targets), inputs=d.inputs, group=0)
                for d in datums]
        where = {id(x): i for i, x in enumerate(seqs)}
        logprobs: list[list[float]] = [[] for _ in seqs]
        total, metrics, parts = 0.0, {}, 0
        with torch.set_grad_enabled(backward):
            for group in self._plan(seqs):
                logp, _ = self._logprobs(self.policy, group, temperature=1.0)
                width = logp.size(1)
                mask = self._grid(group, "mask", width)
                inputs = {name: to_device(pad_right([x.inputs.get(name) or [fn.fill[name]] * len(x.targets) for x in group], 0.0, torch.float32)[:, :width],
                                          self.device) for name in {name for x in group for name in x.inputs}}
                value, extra = fn(logp.float(), inputs, mask, **options)
                if backward:
                    value.backward()
                total += float(value.detach())
                parts += 1
                for k, v in extra.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
                rows = logp.detach().float().cpu()
                for row, x in enumerate(group):
                    logprobs[where[id(x)]] = rows[row, : len(x.targets)].tolist()
        return logprobs, {"loss:sum": total, **{f"{k}:mean": v / parts for k, v in metrics.items()}}

    def optim_step(self, lr: float, *, betas: tuple[float, float], eps: float, weight_decay: float, grad_clip: float) -> dict:
        """One AdamW step on the gradients `forward_backward` added up, with these hyperparameters
        (grad_clip 0: no clipping); the gradients are zeroed after it."""
        for group in self.optimizer.param_groups:
            group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        skipped = self.skipped_updates
        grad_norm = self._optimizer_step(lr, clip=grad_clip if grad_clip > 0 else math.inf)
        return {"optim/grad_norm": float(grad_norm), "optim/lr": lr, "optim/skipped": float(self.skipped_updates - skipped)}

    # -- weights ---------------------------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight by HF name (tied weights once, LoRA merged), full tensors in `dtype` (the
        rollout engine's), for weight sync. Under FSDP2 gathering a full tensor is a collective:
        every rank must iterate this."""
        for name, w in merged_named_weights(self.lm):
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            yield name, (w.to(dtype) if dtype is not None else w)

    def export_hf(self, directory: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
        """An HF checkpoint (safetensors, config, tokenizer, chat template) that vLLM and
        transformers load; LoRA adapters merged; in model.dtype (the rollout engine's). Streamed:
        every rank joins each tensor's gather, one tensor at a time, and only rank 0 keeps it, in
        shards of at most `max_shard_bytes` (to a local directory first when `directory` is an
        fsspec URI)."""
        directory = storage.absolute(directory)
        self.check_finite("HF export")
        if self.rank != 0:
            for _ in self.named_weights():  # each full tensor is a collective every rank joins; only rank 0 keeps any
                pass
            return directory
        dtype = export_dtype(self.cfg.model.dtype, self.model_path)
        return write_hf_to(directory, self.named_weights(), self.model_path, dtype, fused_moe=is_fused_moe(self.lm), max_shard_bytes=max_shard_bytes)

    # -- checkpoints -----------------------------------------------------------------------------------

    def check_finite(self, what: str) -> None:
        """Raises NonFiniteWeights, on every rank, when any rank's shard of the policy holds a
        non-finite value: nothing `what` (a checkpoint, an export) would write from it is written."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.policy.parameters()]
        finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all()) if local else True
        bad = next((name for name, p in self.policy.named_parameters() if not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()),
                   None) if not finite else None
        if self._global_sums([0.0 if finite else 1.0])[0]:
            raise NonFiniteWeights(f"the policy's weights hold non-finite values{f' ({bad} on rank {self.rank})' if bad else ''}: "
                                   f"no {what} written from them")

    def _model_state(self):
        """The policy's state dict for a checkpoint. A 4-bit base is left out: it is `model_path`
        quantized again (NF4 is deterministic), so the checkpoint holds the adapters alone (and the
        optimizer their state); loading it is then not strict about the base's keys."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optim_state = get_state_dict(self.policy, self.optimizer)
        if not self.cfg.trainer.load_in_4bit:
            return model_state, optim_state, None
        return trainable_state(self.policy, model_state), optim_state, StateDictOptions(strict=False)

    def save_checkpoint(self, directory: str | Path) -> str:
        """A resumable, sharded checkpoint (torch.distributed.checkpoint; loadable at any world
        size): model, optimizer, step and every rank's RNG states. The driver adds its own state.
        `directory`: a local or shared path, or an fsspec URI (see raytool.storage)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        directory = storage.absolute(directory)
        self.check_finite("checkpoint")
        model_state, optim_state, _ = self._model_state()
        state = {"model": model_state, "optim": optim_state}
        has_reference = isinstance(self.reference, PolicyModel)
        if has_reference:
            state["reference"] = get_model_state_dict(self.reference)
        with single_process_quiet():
            dcp.save(state, checkpoint_id=storage.join(directory, "dcp"), no_dist=not dist.is_initialized())
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(), "step": self.step, "rl_updates": self.rl_updates}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        with storage.open_file(storage.join(directory, "rng", f"rank{self.rank}.pt"), "wb") as f:
            torch.save(rng, f)
        if self.rank == 0:
            meta = {"model_path": self.model_path, "lora": self.cfg.trainer.lora_rank > 0, "reference": has_reference,
                    "trainer": msgspec.to_builtins(self.cfg.trainer), "model": msgspec.to_builtins(self.cfg.model)}
            for name in HF_FILES:  # what `raytool export` needs besides the weights
                if (Path(self.model_path) / name).is_file():
                    storage.write_bytes(storage.join(directory, "hf_meta", name), (Path(self.model_path) / name).read_bytes())
            storage.write_bytes(storage.join(directory, "trainer_meta.json"), json.dumps(meta, indent=1).encode())
        if self.world_size > 1:
            dist.barrier()
        return directory

    def load_checkpoint(self, directory: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict

        directory = storage.absolute(directory)
        model_state, optim_state, options = self._model_state()
        state = {"model": model_state, "optim": optim_state}
        meta = json.loads(storage.read_bytes(storage.join(directory, "trainer_meta.json")))
        if meta.get("reference"):
            state["reference"] = get_model_state_dict(self._reference())
        with single_process_quiet():
            dcp.load(state, checkpoint_id=storage.join(directory, "dcp"), no_dist=not dist.is_initialized())
        set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
        if meta.get("reference"):
            set_model_state_dict(self.reference, state["reference"])
        rng_file = storage.join(directory, "rng", f"rank{self.rank}.pt")
        if not storage.exists(rng_file):  # resumed at another world size: ranks beyond the saved ones reseed
            rng_file = storage.join(directory, "rng", "rank0.pt")
        with storage.open_file(rng_file) as f:
            rng = torch.load(f, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        self.step, self.rl_updates = rng["step"], rng["rl_updates"]


class _AdaptersOff(torch.nn.Module):
    """The LoRA policy with its adapters disabled: the base model, as a KL reference, for free."""

    def __init__(self, policy: PolicyModel):
        super().__init__()
        self.policy = [policy]  # a list: not registered as a submodule (no second copy in state dicts)

    def forward(self, *args, **kwargs):
        policy = self.policy[0]
        with policy.lm.disable_adapter():
            return policy(*args, **kwargs)
