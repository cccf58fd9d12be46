"""A resumable prompt loader: shuffled epochs by seed, position kept as (epoch, index)."""

from __future__ import annotations

import random
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class PromptLoader(Generic[T]):
    def __init__(self, items: Sequence[T], batch_size: int, seed: int = 0):
        if not items:
            raise ValueError("PromptLoader got an empty dataset")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[T]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index == len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.items[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
