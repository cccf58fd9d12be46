"""Token-budget micro-batches and the two layouts a micro-batch can take on the device.

- padded: one row per sequence, right-padded to the longest; no attention mask (see model.py).
- packed: every sequence end to end in one row, position_ids restarting at 0 per sequence; only
  with a varlen attention kernel (flash-attention), since under plain SDPA transformers turns
  packed position_ids into a dense block mask (measured on an H100: 2x slower at 16k tokens).

- shared prefixes (a tree per row): the sequences of one GRPO group as one trie, each token once
  however many of them share it (the prompt, and any later turns they agree on), each token
  attending to its ancestors alone (a [R, 1, T, T] boolean mask; position ids continue from its
  parent): the same log-probs, losses and gradients as one row per sequence, from fewer tokens
  (AReaL's tree training). Needs an attention that takes a mask (SDPA or eager), not a varlen kernel.

Every layout scores only the positions it needs: `Layout.select` are flat indices of
the positions whose next token is trained on, and `Layout.rows/cols` put the results back into a
[sequences, longest - 1] grid where column t holds log p(ids[t + 1] | ids[:t + 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so each group's padded size (count x longest) fits `max_tokens`.

    Sequences are sorted by length first so similar lengths share a group (little padding); a
    sequence longer than the budget gets a group of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
            longest_if_added = lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        groups.append(current)
    return groups


def packed_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so each group's total length fits `max_tokens` (first-fit
    decreasing: few groups, no padding); a sequence longer than the budget travels alone."""
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(max_tokens - lengths[i])
    return groups


def prefix_tree(seqs: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """The trie of `seqs` -> (its tokens, each in creation order, so a parent always comes first;
    each token's parent, -1 for a first token; each sequence's path: the trie position of each of
    its tokens). Two sequences share a trie token exactly when they agree on every token up to it."""
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> its trie position
    for s in seqs:
        node, path = -1, []
        for token in s:
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            path.append(child)
            node = child
        paths.append(path)
    return tokens, parents, paths


def tree_size(seqs: list[list[int]]) -> int:
    """The number of tokens of the trie of `seqs` (`prefix_tree`)."""
    return len(prefix_tree(seqs)[0])


def shared_prefix_units(seqs: list[list[int]], groups: list, max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped into the trees a micro-batch holds: the sequences of one group
    (None: a group of its own), in lexicographic order, as few trees as keep each within
    `max_tokens` (a sequence longer than that stands alone)."""
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(i if g is None else ("g", g), []).append(i)
    units: list[list[int]] = []
    for indices in members.values():
        current: list[int] = []
        for i in sorted(indices, key=lambda i: seqs[i]):
            if current and tree_size([seqs[j] for j in current + [i]]) > max_tokens:
                units.append(current)
                current = []
            current.append(i)
        units.append(current)
    return units


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (on the host) on `device` without stalling the host. A plain `.to(cuda)` from pageable
    memory waits for the device's queue to drain (PyTorch synchronizes the stream after a blocking
    copy), so the host could not queue the next kernels while the last micro-batch runs; a pinned
    (page-locked, from the caching host allocator) non-blocking copy is ordered on the stream and
    returns at once."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pad_right(rows: list[list], value, dtype=torch.long) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


@dataclass
class Layout:
    input_ids: torch.Tensor  # [R, T]
    position_ids: torch.Tensor | None  # [R, T] when packed
    select: torch.Tensor  # [N] flat indices into R*T of the scored positions
    labels: torch.Tensor  # [N] the token after each scored position
    rows: torch.Tensor  # [N] sequence index of each scored position
    cols: torch.Tensor  # [N] its column in the [B, W] grid
    shape: tuple[int, int]  # (B, W): sequences x (longest - 1)
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [B + 1], where each sequence starts in the row, then its end
    longest: int = 0  # the longest sequence's length
    attention_mask: torch.Tensor | None = None  # shared prefixes: bool [R, 1, T, T], True where a token attends to another

    def varlen_kwargs(self) -> dict:
        """A packed row's sequence bounds as transformers' flash-attention kwargs: computed here on
        the host, so its varlen kernel need not derive them from the position ids in every layer
        (a nonzero() and a max() read back from the device: synchronisations)."""
        if self.cu_seqlens is None:
            return {}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, "max_length_q": self.longest, "max_length_k": self.longest}

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """[N] scored values -> [B, W] (0 where nothing was scored), differentiable."""
        grid = values.new_zeros(self.shape)
        return grid.index_put((self.rows, self.cols), values)


def layout(seqs: list[list[int]], scored: list[list[int]], pad_id: int, packed: bool, device, trees: list[list[int]] | None = None,
           targets: list[list[int] | None] | None = None) -> Layout:
    """`scored[b]` holds the columns t of sequence b to score (predicting seqs[b][t + 1]); a
    micro-batch with nothing to score still scores its first position, so that every rank runs
    a backward pass through every parameter (FSDP's collectives must match across ranks).
    `trees`: the sequence indices of each row's trie (shared prefixes), instead of one row per
    sequence. `targets[b]` (None: the next tokens): the token column t of sequence b predicts
    instead of seqs[b][t + 1] (a Tinker datum's `target_tokens`)."""
    if not any(scored):
        scored = [[0]] + [[] for _ in seqs[1:]]
    label = (lambda b, s, t: s[t + 1]) if targets is None else (lambda b, s, t: s[t + 1] if targets[b] is None else targets[b][t])
    if trees is not None:
        return _tree_layout(seqs, scored, trees, pad_id, device, label)
    rows, cols, labels, flat = [], [], [], []
    if packed:
        offset = 0
        for b, (s, cs) in enumerate(zip(seqs, scored)):
            for t in cs:
                rows.append(b), cols.append(t), labels.append(label(b, s, t)), flat.append(offset + t)
            offset += len(s)
        ids = torch.tensor([[x for s in seqs for x in s]])
        positions = torch.tensor([[p for s in seqs for p in range(len(s))]])
        bounds = torch.tensor([0, *(len(s) for s in seqs)], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    else:
        ids = pad_right(seqs, pad_id)
        width = ids.size(1)
        for b, (s, cs) in enumerate(zip(seqs, scored)):
            for t in cs:
                rows.append(b), cols.append(t), labels.append(label(b, s, t)), flat.append(b * width + t)
        positions = bounds = None
    as_long = lambda xs: to_device(torch.tensor(xs, dtype=torch.long), device)  # noqa: E731
    return Layout(
        input_ids=to_device(ids, device), position_ids=to_device(positions, device) if positions is not None else None,
        select=as_long(flat), labels=as_long(labels), rows=as_long(rows), cols=as_long(cols),
        shape=(len(seqs), max(len(s) for s in seqs) - 1),
        cu_seqlens=to_device(bounds, device) if bounds is not None else None, longest=max(len(s) for s in seqs),
    )


def _tree_layout(seqs: list[list[int]], scored: list[list[int]], trees: list[list[int]], pad_id: int, device, label) -> Layout:
    """One row per trie of `trees`, right-padded: a token sees its ancestors and itself, a pad
    only itself (its output is never read; a row with nothing to attend to would be NaN)."""
    import numpy as np

    built = [prefix_tree([seqs[b] for b in tree]) for tree in trees]
    width = max(len(tokens) for tokens, _, _ in built)
    ids = torch.full((len(trees), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(trees), width), dtype=torch.long)
    mask = np.zeros((len(trees), 1, width, width), dtype=bool)
    rows, cols, labels, flat = [], [], [], []
    for r, (tree, (tokens, parents, paths)) in enumerate(zip(trees, built)):
        ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        depth = np.zeros(width, dtype=np.int64)
        seen = mask[r, 0]
        for i, parent in enumerate(parents):  # a parent comes before its children: its row is complete
            if parent >= 0:
                seen[i] = seen[parent]
                depth[i] = depth[parent] + 1
            seen[i, i] = True
        pads = np.arange(len(tokens), width)
        seen[pads, pads] = True
        positions[r] = torch.from_numpy(depth)
        for b, path in zip(tree, paths):
            for t in scored[b]:
                rows.append(b), cols.append(t), labels.append(label(b, seqs[b], t)), flat.append(r * width + path[t])
    as_long = lambda xs: to_device(torch.tensor(xs, dtype=torch.long), device)  # noqa: E731
    return Layout(
        input_ids=to_device(ids, device), position_ids=to_device(positions, device), select=as_long(flat), labels=as_long(labels),
        rows=as_long(rows), cols=as_long(cols), shape=(len(seqs), max(len(s) for s in seqs) - 1), longest=width,
        attention_mask=to_device(torch.from_numpy(mask), device),
    )


def split_across_ranks(lengths: list[list[int]], world_size: int, sequence_parallel: int = 1) -> list[dict[int, list[int]]]:
    """Balance a batch over data-parallel ranks by tokens: `lengths[g][i]` is the length of
    trajectory i of group g. Returns, per rank, {group: [trajectory positions]} (a group may be
    split: advantages are computed from the whole batch's rewards, not per rank). Longest first,
    each to the rank with the fewest tokens so far (LPT scheduling). With sequence parallelism the
    `sequence_parallel` consecutive ranks of an SP group get the same share."""
    if sequence_parallel > 1:
        shares = split_across_ranks(lengths, world_size // sequence_parallel)
        return [shares[rank // sequence_parallel] for rank in range(world_size)]
    items = sorted(((n, g, i) for g, group in enumerate(lengths) for i, n in enumerate(group)), key=lambda x: (-x[0], x[1], x[2]))
    load = [0] * world_size
    out: list[dict[int, list[int]]] = [{} for _ in range(world_size)]
    for n, g, i in items:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += n
        out[rank].setdefault(g, []).append(i)
    for share in out:
        for positions in share.values():
            positions.sort()
    return out
