"""Token-budget micro-batching and padding of variable-length sequences."""

from __future__ import annotations

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


def pad_right(rows: list[list[int]], value: int, dtype=torch.long) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out
