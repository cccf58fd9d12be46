"""Reward functions: a registry selected by `reward.fn`, user fns from `file.py:function`, and the
shaping every fn gets from `RewardConfig` (format penalty, DAPO overlong).

A reward fn is `(trajectory_view, ground_truth, extra) -> float | dict(score=..., **metrics)`;
`trajectory_view` is `raytool.agent.loop.reward_view(traj)` (the question `prompt`, the final
assistant text `response`, `turns`, `num_turns`, `tool_calls`, `tool_errors`, `finish_reason`,
`response_tokens`, `max_response_tokens`, `solution_str`); `extra` carries the row's `data_source` and `extra_info`.
A registered name maps to a builder `(RewardConfig) -> reward fn`; the built-ins return `score`,
`acc`, `has_answer` and `verify_timeout`; `judge` asks an LLM judge (raytool.rewards.llm_judge).

A user's file may instead hold a verl reward function, `compute_score(data_source, solution_str,
ground_truth, extra_info=None)` (any function with a `solution_str` parameter): it is called the
way verl calls it, by keyword, with `solution_str` the whole response decoded without special
tokens (tool output included) and `extra_info` the row's extra info plus verl's `num_turns` (the
prompt, each assistant turn and each round of tool responses), `rollout_reward_scores` ({}),
and raytool's `tool_calls` and `tool_errors`; of a returned dict, the numbers are metrics and
other values (verl's free-form extras) are left out.
"""

from __future__ import annotations

import inspect
import json
import traceback
from pathlib import Path
from typing import Callable

from raytool.config import ConfigError, RewardConfig
from raytool.errors import RaytoolError, one_line
from raytool.imports import module_from_file
from raytool.rewards.math import extract_answer, judge, last_boxed, normalize_answer, strip_interpreter
from raytool.rewards.verify import MathVerifier

RewardFn = Callable[[dict, str, dict], "float | dict"]
REWARDS: dict[str, Callable[[RewardConfig], RewardFn]] = {}


class RewardError(RaytoolError):
    """A reward fn raised; the message names the fn, the data source and where in the fn."""


def register(name: str):
    def wrap(builder: Callable[[RewardConfig], RewardFn]):
        REWARDS[name] = builder
        return builder

    return wrap


_VERIFIERS: dict[float, MathVerifier] = {}


def shared_verifier(timeout_s: float) -> MathVerifier:
    """One math-verify child process per timeout in this process, shared by every fn built here."""
    if timeout_s not in _VERIFIERS:
        _VERIFIERS[timeout_s] = MathVerifier(timeout_s)
    return _VERIFIERS[timeout_s]


@register("boxed_match")
def boxed_match(cfg: RewardConfig) -> RewardFn:
    """1/0: the last \\boxed{} of the model's text equals the ground truth after normalization."""

    def score(view: dict, ground_truth: str, extra: dict) -> dict:
        result = judge(last_boxed(strip_interpreter(view["response"])), ground_truth, verifier=None)
        return {"score": result["acc"], **result}

    return score


@register("math")
def math_reward(cfg: RewardConfig) -> RewardFn:
    """1/0: the final answer (by the data source's convention) is equal to the ground truth per math-verify."""
    verifier = shared_verifier(cfg.timeout_s)

    def score(view: dict, ground_truth: str, extra: dict) -> dict:
        result = judge(extract_answer(view["response"], extra.get("data_source")), ground_truth, verifier)
        return {"score": result["acc"], **result}

    return score


@register("retool")
def retool(cfg: RewardConfig) -> RewardFn:
    """ReTool / verl's recipe: +1 correct; -1 wrong, plus `tool_call_bonus` per tool call, at most
    `wrong_score_cap` (verl: min(-0.6, -1 + 0.1 * calls)), so a wrong answer never outscores a correct one."""
    verifier = shared_verifier(cfg.timeout_s)

    def score(view: dict, ground_truth: str, extra: dict) -> dict:
        result = judge(extract_answer(view["response"], extra.get("data_source")), ground_truth, verifier)
        wrong = min(cfg.wrong_score_cap, -1.0 + cfg.tool_call_bonus * view["tool_calls"])
        return {"score": 1.0 if result["acc"] else wrong, **result}

    return score


def overlong_penalty(response_tokens: int, max_response_tokens: int, buffer_tokens: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linear up to `factor` at max."""
    exceed = response_tokens - (max_response_tokens - buffer_tokens)
    return min(max(exceed, 0) / buffer_tokens, 1.0) * factor


def normalize_score(value) -> tuple[float, dict]:
    """A reward fn's return value -> (score, extra metrics)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score': {sorted(value)}")
        extra = {k: float(v) for k, v in value.items() if k != "score"}
        return float(value["score"]), extra
    return float(value), {}


def _config_error(spec: str, what: str) -> ConfigError:
    return ConfigError(f"config key 'reward.fn': '{spec}': {what}")


VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")


def as_verl_reward(fn: Callable, accepted: set[str]) -> RewardFn:
    """verl's `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)` as a raytool
    reward fn; `accepted`: which of verl's keywords it takes."""

    def score(view: dict, ground_truth: str, extra: dict) -> float | dict:
        extra_info = {**(extra.get("extra_info") or {}), "num_turns": view["verl_num_turns"], "rollout_reward_scores": {},
                      "tool_calls": view["tool_calls"], "tool_errors": view["tool_errors"]}
        truth = json.loads(ground_truth) if extra.get("ground_truth_json") else ground_truth  # a list or dict as verl passes it
        arguments = {"data_source": extra.get("data_source"), "solution_str": view["solution_str"], "ground_truth": truth,
                     "extra_info": extra_info}
        value = fn(**{k: v for k, v in arguments.items() if k in accepted})
        if isinstance(value, dict):  # verl's dicts may carry text (a prediction, a reason): metrics are numbers
            return {k: v for k, v in value.items() if k == "score" or isinstance(v, (int, float))}
        return value

    return score


def load_reward_fn(spec: str) -> RewardFn:
    """The user's function named by `path/to/file.py:function` (the path relative to the working
    directory), raytool's `(trajectory_view, ground_truth, extra)` or verl's `compute_score(data_source,
    solution_str, ground_truth, extra_info=None)`; a ConfigError naming `reward.fn`, the file and
    what is wrong otherwise."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise _config_error(spec, f"not a registered reward ({', '.join(sorted(REWARDS))}) nor path/to/file.py:function")
    if not Path(path).is_file():
        raise _config_error(spec, f"file {path} not found (relative paths start at {Path.cwd()})")
    try:
        module = module_from_file(path, f"raytool_user_reward_{Path(path).stem}")
    except SyntaxError as exc:
        raise _config_error(spec, f"{path} line {exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        raise _config_error(spec, f"importing {path} failed: {one_line(exc)}") from None
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise _config_error(spec, f"{path} has no function '{name}' (it defines: {', '.join(defined) or 'none'})")
    if not callable(fn):
        raise _config_error(spec, f"{path}: '{name}' is not a function (it is a {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: let the call tell
        return fn
    parameters = signature.parameters
    if "solution_str" in parameters:  # verl's convention
        takes_any = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        accepted = {k for k in VERL_PARAMETERS if k in parameters or takes_any}
        try:
            signature.bind(**dict.fromkeys(accepted))
        except TypeError:
            raise _config_error(spec, f"{name}{signature} takes verl's solution_str but cannot be called as verl calls it, "
                                      f"{name}(data_source=, solution_str=, ground_truth=, extra_info=)") from None
        if "ground_truth" not in accepted:
            raise _config_error(spec, f"{name}{signature} takes verl's solution_str but no ground_truth")
        return as_verl_reward(fn, accepted)
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise _config_error(spec, f"{name}{signature} fits neither signature a reward fn may have: raytool's "
                                  f"{name}(trajectory_view, ground_truth, extra) or verl's "
                                  f"{name}(data_source, solution_str, ground_truth, extra_info=None)") from None
    return fn


@register("judge")
def judge_reward(cfg: RewardConfig, own_api: Callable[[], str] | None = None) -> RewardFn:
    """`own_api`: where the run's gateway serves, for a judge that is the run's own model (base_url
    self). (Not named llm_judge: importing that submodule would rebind the package's name.)"""
    from raytool.rewards.llm_judge import Judge

    return Judge(cfg.judge, own_api)


def validate_reward_fn(spec: str) -> None:
    """Raise a one-line ConfigError unless `reward.fn` names a registered reward or a loadable
    `file.py:function` taking (trajectory_view, ground_truth, extra). Imports the user's file."""
    if spec not in REWARDS:
        load_reward_fn(spec)


def check_judge(cfg: RewardConfig, rows: list) -> None:
    """With reward.fn=judge: its settings against the rows (`PromptRow`s) and one call to the
    judge's API, before any actor starts; each failure one line naming the key."""
    if cfg.fn == "judge":
        from raytool.rewards.llm_judge import check_config, probe

        check_config(cfg.judge, [set(row.extra_info) for row in rows])
        probe(cfg.judge)


def make_reward_fn(cfg: RewardConfig, own_api: Callable[[], str] | None = None) -> Callable[[dict, str, dict], tuple[float, dict]]:
    """The configured reward as `(view, ground_truth, extra) -> (score, metrics)`, with the format
    penalty and overlong shaping applied; a failing fn raises a one-line RewardError. `own_api`:
    where the run's gateway serves, for a judge that is the run's own model (reward.judge.base_url self)."""
    if cfg.fn == "judge":  # the one reward that may call the run itself
        fn = judge_reward(cfg, own_api)
    else:
        fn = REWARDS[cfg.fn](cfg) if cfg.fn in REWARDS else load_reward_fn(cfg.fn)

    def reward(view: dict, ground_truth: str, extra: dict) -> tuple[float, dict]:
        try:
            score, metrics = normalize_score(fn(view, ground_truth, extra))
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f" (at {Path(frame.filename).name} line {frame.lineno})"
            raise RewardError(f"reward fn '{cfg.fn}' failed on a row of data source '{extra.get('data_source', '?')}': "
                              f"{one_line(exc)}{where}") from None
        if cfg.format_penalty and metrics.get("has_answer") == 0.0:
            score -= cfg.format_penalty
        if cfg.overlong_buffer_tokens:
            if view.get("max_response_tokens") is None:
                raise RewardError("reward.overlong_buffer_tokens is set but the trajectory view has no max_response_tokens "
                                  "(pass agent.max_response_tokens to reward_view)")
            penalty = overlong_penalty(view["response_tokens"], view["max_response_tokens"], cfg.overlong_buffer_tokens,
                                       cfg.overlong_penalty_factor)
            score -= penalty
            metrics["overlong_penalty"] = penalty
        return score, metrics

    reward.concurrency = getattr(fn, "concurrency", 1)  # calls at once a fn takes (a judge: reward.judge.concurrency)
    return reward


__all__ = [
    "REWARDS", "RewardError", "RewardFn", "check_judge", "extract_answer", "judge", "load_reward_fn", "make_reward_fn",
    "normalize_answer", "normalize_score", "overlong_penalty", "register", "shared_verifier", "validate_reward_fn",
]
