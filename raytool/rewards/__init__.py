"""Reward functions: answer extraction, verification, and a registry selected by config name.

A reward fn is `(trajectory_view, ground_truth, extra) -> float | dict(score=..., **metrics)`;
`trajectory_view` is a dict with the final answer text (`response`), the assistant turns and the
tool-call counts. Config names a registered fn or `path/to/file.py:function`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

from raytool.rewards.math import boxed_match

RewardFn = Callable[[dict, str, dict], "float | dict"]

REWARDS: dict[str, RewardFn] = {"boxed_match": boxed_match}


def register(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return wrap


def get_reward_fn(spec: str) -> RewardFn:
    if spec in REWARDS:
        return REWARDS[spec]
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise ValueError(f"reward.fn '{spec}': not a registered reward ({sorted(REWARDS)}) nor 'file.py:function'")
    if not Path(path).is_file():
        raise FileNotFoundError(f"reward.fn '{spec}': file {path} not found")
    module_spec = importlib.util.spec_from_file_location(f"raytool_user_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, func, None)):
        raise AttributeError(f"reward.fn '{spec}': {path} has no function '{func}'")
    return getattr(module, func)


def normalize_score(value) -> tuple[float, dict]:
    """A reward fn's return value -> (score, extra metrics)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward fn returned a dict without 'score': {sorted(value)}")
        extra = {k: float(v) for k, v in value.items() if k != "score"}
        return float(value["score"]), extra
    return float(value), {}
