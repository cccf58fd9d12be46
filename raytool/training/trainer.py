"""The trainer: an HF causal LM, AdamW, and the GRPO (PPO-clip) and SFT steps over micro-batches.

One `Trainer` lives in each TrainerWorker process. With `world_size > 1` the model is sharded with
FSDP2 (`fully_shard` per decoder layer, then the root) over the already-initialized process group,
and each rank trains on its own slice of the batch.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytool.algos import get_adv_estimator, get_policy_loss, masked_aggregate
from raytool.training.batching import micro_batches, pad_right
from raytool.types import SFTExample, Trajectory

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainerSettings:
    lr: float = 2e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    loss_agg: str = "token-mean"
    ppo_epochs: int = 1
    mini_batches: int = 1
    seed: int = 0
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are of softmax(logits / T)


@dataclass
class _Seq:
    ids: list[int]
    mask: list[int]  # aligned with ids[1:]: 1 where the loss sees the token
    adv: float = 0.0
    rollout: list[float] | None = None  # engine log-probs, aligned like mask (0.0 where mask is 0)
    old: list[float] | None = None  # old-policy log-probs when the update is not purely on-policy


def _token_logprobs(model, input_ids: torch.Tensor, attention: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1 under softmax(logits / temperature), shape [B, T-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    labels = input_ids[:, 1:]
    return -F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none").view_as(labels)


class Trainer:
    def __init__(self, model_path: str, settings: TrainerSettings, *, dtype: str = "float32", device: str = "cpu", rank: int = 0, world_size: int = 1):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(settings.seed)
        self.settings = settings
        self.model_path = model_path
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(self.device)
        self.model.train()
        self.model.config.use_cache = False
        if world_size > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.model.layers:
                fully_shard(layer)
            fully_shard(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        self.step = 0

    # -- helpers -------------------------------------------------------------------------------

    def _tensors(self, seqs: list[_Seq]):
        ids = pad_right([s.ids for s in seqs], self.pad_id).to(self.device)
        attention = pad_right([[1] * len(s.ids) for s in seqs], 0).to(self.device)
        mask = pad_right([s.mask for s in seqs], 0, dtype=torch.float32).to(self.device)
        width = ids.size(1) - 1
        return ids, attention, mask[:, :width]

    def _plan(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        """Token-budget micro-batches of `seqs`. Under FSDP every forward/backward is a collective,
        so every rank runs as many micro-batches as the busiest one: the others add a dummy whose
        mask is all 0 (it contributes exactly nothing to the loss or the gradients)."""
        groups = [[seqs[i] for i in g] for g in micro_batches([len(x.ids) for x in seqs], self.settings.micro_batch_tokens)]
        if self.world_size > 1:
            count = torch.tensor([len(groups)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            dummy = _Seq(ids=[self.pad_id, self.pad_id], mask=[0], rollout=[0.0], old=[0.0])
            groups += [[dummy]] * (int(count.item()) - len(groups))
        return groups

    def _global_sum(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item()

    def _optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            for p in group["params"]:  # a step with no gradient still moves AdamW's moments: keep it
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- RL ------------------------------------------------------------------------------------

    def rl_step(self, trajectories: list[Trajectory]) -> dict:
        """One GRPO/PPO update on a batch of finished trajectories; returns metrics."""
        s = self.settings
        start = time.perf_counter()
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        adv = get_adv_estimator(s.adv_estimator)(rewards, [t.group_id for t in trajectories], norm_by_std=s.norm_adv_by_std)
        seqs = [
            _Seq(
                ids=t.prompt_ids + t.response_ids,
                mask=[0] * (len(t.prompt_ids) - 1) + list(t.response_mask),
                adv=float(a),
                rollout=[0.0] * (len(t.prompt_ids) - 1) + list(t.rollout_logprobs),
            )
            for t, a in zip(trajectories, adv)
        ]
        if self.world_size > 1:  # each rank trains on its own slice
            seqs = seqs[self.rank :: self.world_size]
        loss_fn = get_policy_loss(s.policy_loss)
        skip_zero_adv = getattr(loss_fn, "zero_advantage_is_noop", False)
        active = [x for x in seqs if x.adv != 0.0 or not skip_zero_adv]  # the rest would add exactly nothing
        on_policy = s.ppo_epochs == 1 and s.mini_batches == 1
        if not on_policy:
            self._fill_old_logprobs(active)
        metrics: dict[str, list[float]] = {"actor/skipped_seq_frac": [1.0 - len(active) / max(len(seqs), 1)]}
        tokens = 0
        for _ in range(s.ppo_epochs):
            order = torch.randperm(len(seqs)).tolist()
            for m in range(s.mini_batches):
                mini = [seqs[i] for i in order[m :: s.mini_batches]]
                # Normalizers count every sequence, skipped ones too: the loss stays the same.
                n_tokens = self._global_sum(sum(sum(x.mask) for x in mini))
                n_seqs = self._global_sum(len(mini))
                for group in self._plan([x for x in mini if x.adv != 0.0 or not skip_zero_adv]):
                    ids, attention, mask = self._tensors(group)
                    width = mask.size(1)
                    logp = _token_logprobs(self.model, ids, attention, s.temperature)
                    old_logp = logp.detach() if on_policy else pad_right([x.old for x in group], 0.0, torch.float32).to(logp.device)[:, :width]
                    adv_t = torch.tensor([x.adv for x in group], device=logp.device).unsqueeze(1).expand_as(logp)
                    loss, extra = loss_fn(
                        logp, old_logp, adv_t, mask,
                        clip_low=s.clip_ratio_low, clip_high=s.clip_ratio_high, agg=s.loss_agg,
                        num_tokens=max(n_tokens, 1.0),
                    )
                    if s.loss_agg != "token-mean":  # per-micro-batch means -> share of the mini-batch
                        loss = loss * len(group) / max(n_seqs, 1.0)
                    # FSDP averages gradients over ranks; the global normalizers above already
                    # divide by the whole batch, so undo that average.
                    (loss * self.world_size).backward()
                    tokens += int(attention.sum())
                    with torch.no_grad():  # how far the trainer's log-probs are from the engine's
                        rollout = pad_right([x.rollout for x in group], 0.0, torch.float32).to(logp.device)[:, :width]
                        diff = ((logp.detach() - rollout).abs() * mask).sum() / mask.sum().clamp(min=1.0)
                    extra["rollout/logprob_abs_diff"] = diff.item()
                    for k, v in extra.items():
                        metrics.setdefault(k, []).append(v)
                    metrics.setdefault("actor/pg_loss", []).append(loss.item())
                metrics.setdefault("actor/grad_norm", []).append(self._optimizer_step(s.lr))
        self.step += 1
        elapsed = time.perf_counter() - start
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["actor/pg_loss"] = self._global_sum(sum(metrics.get("actor/pg_loss", [0.0]))) / (s.ppo_epochs * s.mini_batches)
        out.update({"actor/lr": s.lr, "perf/train_tokens_per_s": tokens / max(elapsed, 1e-9), "adv/abs_mean": adv.abs().mean().item()})
        return out

    @torch.no_grad()
    def _fill_old_logprobs(self, seqs: list[_Seq]) -> None:
        """The policy's log-probs before this update (needed once a batch is used for > 1 step)."""
        for group in self._plan(seqs):
            ids, attention, _ = self._tensors(group)
            logp = _token_logprobs(self.model, ids, attention, self.settings.temperature).cpu()
            for row, x in enumerate(group):
                x.old = logp[row, : len(x.ids) - 1].tolist()

    # -- SFT -----------------------------------------------------------------------------------

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        """One supervised step: token-mean cross-entropy where loss_mask is 1."""
        seqs = [_Seq(ids=e.input_ids, mask=e.loss_mask[1:]) for e in examples]
        if self.world_size > 1:
            seqs = seqs[self.rank :: self.world_size]
        n_tokens = max(self._global_sum(sum(sum(s.mask) for s in seqs)), 1.0)
        total = 0.0
        for group in self._plan(seqs):
            ids, attention, mask = self._tensors(group)
            nll = -_token_logprobs(self.model, ids, attention)
            loss = masked_aggregate(nll, mask, "token-mean", n_tokens)
            (loss * self.world_size).backward()
            total += loss.item()
        grad_norm = self._optimizer_step(lr)
        self.step += 1
        return {"sft/loss": self._global_sum(total), "sft/grad_norm": grad_norm, "sft/lr": lr}

    # -- weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter by HF name (tied weights once), as full tensors, for weight sync.

        Under FSDP2 gathering a full tensor is a collective: every rank must iterate this.
        """
        for name, param in self.model.named_parameters():
            param = param.detach()
            yield name, param.full_tensor() if hasattr(param, "full_tensor") else param

    def save(self, directory: str | Path) -> Path:
        """An HF checkpoint (safetensors + tokenizer) plus optimizer and trainer state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        directory = Path(directory)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(directory, state_dict=state)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
                src = Path(self.model_path) / name
                if src.is_file():
                    shutil.copy(src, directory / name)
            if self.world_size == 1:
                torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
            (directory / "trainer_state.json").write_text(json.dumps({"step": self.step}))
        return directory
