"""Ulysses sequence parallelism: the ranks of an SP group each hold 1/SP of every sequence.

Every rank of a group sees the same micro-batch and runs the decoder on its contiguous slice of
the sequence dimension. Token-wise layers (embeddings, norms, MLPs, rotary with the global
position ids) need nothing else; attention exchanges heads for sequence with an all-to-all, so
each rank attends over the whole sequence with 1/SP of the heads, and a second all-to-all gives
the sequence slices back. Each rank scores the positions its slice holds; the log-probs (and
entropies) are gathered so that every rank of the group computes the same loss on the whole
micro-batch, and each backpropagates through its own positions only (the gather's backward takes
the rank's own part), which sums to the full gradient across the group.

Attention runs in PyTorch's SDPA over the gathered sequence: causal for right-padded rows, a
block-causal mask built from the packed position ids for packed rows. Key/value heads that SP
does not divide (grouped-query attention with few KV heads) are repeated up to the query heads
first.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

ATTENTION = "raytool_ulysses"  # the attn_implementation name the SP policy's layers are built with

# The group and the whole micro-batch's position ids, set by each forward and kept until the next:
# activation checkpointing recomputes attention during backward, on autograd's thread.
_state = SimpleNamespace(group=None, positions=None, packed=False)


def register_attention() -> None:
    """Make `ATTENTION` a transformers attention implementation (idempotent). No mask function is
    registered: transformers then passes no mask, and the attention builds its own from the whole
    sequence's position ids."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)


def check_heads(heads: int, sp: int) -> None:
    """SP splits the attention heads: refuse, in one line, a model whose head count it does not divide."""
    if heads % sp:
        raise ValueError(f"config key 'trainer.sequence_parallel_size' is {sp}, which does not divide the model's "
                         f"{heads} attention heads (Ulysses SP gives each rank heads/SP of them): pick a divisor of {heads}")


def set_micro_batch(group, positions: torch.Tensor, packed: bool) -> None:
    """Before the decoder runs: `positions` [R, T] are the whole (padded) micro-batch's position ids."""
    _state.group, _state.positions, _state.packed = group, positions, packed


def _seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, H, t, D] (all heads, this rank's slice) -> [B, H/sp, sp*t, D] (this rank's heads, the whole sequence)."""
    b, h, t, d = x.shape
    send = x.reshape(b, sp, h // sp, t, d).permute(1, 0, 2, 3, 4).contiguous()  # by destination rank
    recv = funcol.all_to_all_single_autograd(send.flatten(), None, None, group).view(sp, b, h // sp, t, d)  # by source slice
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def _heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [B, H/sp, sp*t, D] -> [B, H, t, D]."""
    b, hl, full, d = x.shape
    t = full // sp
    send = x.reshape(b, hl, sp, t, d).permute(2, 0, 1, 3, 4).contiguous()  # by destination (sequence slice)
    recv = funcol.all_to_all_single_autograd(send.flatten(), None, None, group).view(sp, b, hl, t, d)  # by source (head block)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, sp * hl, t, d)


def _block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[R, 1, T, T] bool: a position sees the earlier positions of its own packed sequence."""
    seq = torch.cumsum((positions == 0).long(), dim=-1)  # sequence number of each position
    same = seq.unsqueeze(-1) == seq.unsqueeze(-2)
    causal = torch.ones(positions.size(-1), positions.size(-1), dtype=torch.bool, device=positions.device).tril()
    return (same & causal).unsqueeze(1)


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function: query [B, Hq, t, D], key/value [B, Hkv, t, D] of this
    rank's sequence slice; returns ([B, t, Hq, D], None) as transformers' own functions do."""
    group, positions = _state.group, _state.positions
    sp = dist.get_world_size(group)
    if key.size(1) % sp:
        repeat = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (_seq_to_heads(x, group, sp) for x in (query, key, value))
    mask = _block_causal_mask(positions) if _state.packed else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0, enable_gqa=k.size(1) != q.size(1))
    return _heads_to_seq(out, group, sp).transpose(1, 2).contiguous(), None


class _GatherSlices(torch.autograd.Function):
    """Concatenate every rank's [n_r] values in rank order; backward: this rank's own part of the
    gradient (every rank computes the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group):
        ctx.span = (sum(counts[:rank]), counts[rank])
        width = max(counts)
        padded = torch.zeros(width, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, n = ctx.span
        return grad[start : start + n], None, None, None


class Slicing:
    """How one micro-batch splits over an SP group: the padded input, this rank's slice of it, and
    the scored positions each rank holds."""

    def __init__(self, input_ids: torch.Tensor, select: torch.Tensor, position_ids: torch.Tensor | None, pad_id: int, group):
        self.group, self.sp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        rows, width = input_ids.shape
        padded = -(-width // self.sp) * self.sp
        self.chunk = padded // self.sp
        if position_ids is None:
            position_ids = torch.arange(width, device=input_ids.device).expand(rows, width)
        extra = padded - width
        if extra:  # pads after the last real token; their positions continue its sequence (causal: seen by nothing real)
            input_ids = F.pad(input_ids, (0, extra), value=pad_id)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, extra + 1, device=input_ids.device)], dim=1)
        self.positions = position_ids
        start = self.rank * self.chunk
        self.input_ids = input_ids[:, start : start + self.chunk]
        self.local_positions = position_ids[:, start : start + self.chunk]
        row, col = select // width, select % width
        owner = col // self.chunk
        self.counts = torch.bincount(owner, minlength=self.sp).tolist()
        mine = owner == self.rank
        self.local_select = row[mine] * self.chunk + (col[mine] - start)
        self.mine = mine
        # gathered (rank-major) value i belongs to select's position order[i]; inverse puts them back
        self.inverse = torch.argsort(torch.argsort(owner, stable=True))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's values of its scored positions, back in `select`'s order."""
        return _GatherSlices.apply(local, self.counts, self.rank, self.group).index_select(0, self.inverse)
