"""The `verifiers` agent loop: environments written for Prime Intellect's `verifiers` package,
rolled out through raytool's gateway and scored by their own rubric.

`agent.environment` names the environment: an installed environment's id (`vf-math`, as
`verifiers.load_environment` takes it) or `package.module:load_environment` /
`path/to/file.py:load_environment`; `agent.environment_args` are its keyword arguments. With
`data.task: verifiers` (or `auto` with no `data.train_files`) the environment's dataset gives the
prompt rows and its eval dataset the validation rows; rows from files with `agent_name: verifiers`
are mapped onto the environment's input (`ground_truth` as its `answer`, `extra_info.info` as
its `info`).

Each trajectory runs the environment's own `rollout` (its client calls, tool calls and multi-turn
protocol unchanged) with a `verifiers` chat-completions client on the trajectory's own gateway URL,
so every call is one generate on the rollout servers, recorded token-exactly. When the group's
rollouts are done the environment's rubric scores them together (`Rubric.score_group`: group-level
reward functions see the whole group): its weighted sum is each trajectory's reward and every
reward function's value is in `reward_extra` (a metric per step, `reward/fn/NAME`). `reward.fn`
scores the run's other rows.

Failures: a `verifiers` error the environment recorded (an invalid model response, a tool call it
could not run) ends the trajectory with finish reason `env_error` (the error's first line in
`agent_error`) and it is scored and trained as the environment scored it; an environment that
raises anything else, a `verifiers.InfraError`, a rubric that raises, hangs past
`reward.call_timeout_s` or returns a non-number make the trajectory infra-failed (`env: ...`), so
its group is rolled out again and never trained on a made-up score. Tool functions of a verifiers
`ToolEnv` run in the agent worker's process, as verifiers runs them (not in raytool's sandbox).
Needs the `verifiers` package (`pip install raytool[verifiers]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import math
import signal
import threading
from pathlib import Path

from raytool.agent.openai_loop import MODEL_NAME, first_line, recording
from raytool.agent.registry import register_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, ConfigError, RolloutConfig
from raytool.errors import one_line
from raytool.types import TIME_LIMIT, Message, Trajectory

log = logging.getLogger(__name__)

_ENVIRONMENTS: dict[str, object] = {}  # per process: the loaded environment of each (spec, args)
_STATES: dict[str, tuple[object, dict]] = {}  # per process: uid -> (environment, state) of a rolled-out trajectory awaiting its group's scoring
# The failures of reward functions while one group is scored: verifiers logs a reward function that
# raises and scores it 0.0, which raytool must not train on (the group is infra-failed instead).
_FAILURES: contextvars.ContextVar[list | None] = contextvars.ContextVar("raytool_verifiers_failures", default=None)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _guarded(func):
    """`func` (a rubric's reward function or metric), recording in the group's failures when it
    raises or returns anything but finite numbers; its signature and name stay verifiers' to read."""
    @functools.wraps(func)
    async def guarded(*args, **kwargs):
        try:
            value = func(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
            if not (_number(value) or isinstance(value, list) and all(_number(v) for v in value)):
                raise TypeError(f"returned {value!r}, not a finite number")
            return value
        except Exception as exc:
            failures = _FAILURES.get()
            if failures is not None:
                failures.append(f"{getattr(func, '__name__', func)}: {first_line(exc)}")
            raise

    guarded.raytool_guarded = True
    return guarded


def _guard_rubric(rubric) -> None:
    """Guard every reward function of `rubric` and of the rubrics it groups, once."""
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        rubric.funcs = [f if getattr(f, "raytool_guarded", False) else _guarded(f) for f in funcs]
    for inner in getattr(rubric, "rubrics", None) or []:
        _guard_rubric(inner)


def _key(spec: str, args: dict) -> str:
    return spec + "\0" + json.dumps(args, sort_keys=True, default=str)


@contextlib.contextmanager
def _process_signals_kept():
    """verifiers' Environment installs SIGINT/SIGTERM handlers as it is built, which Python allows
    only on the main thread; an agent worker builds it on its event loop's thread. There the
    handlers are not installed (the worker keeps Ray's); on the main thread (the driver) they are."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    install = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)
    try:
        yield
    finally:
        signal.signal = install


def load_environment(spec: str | None, args: dict):
    """The verifiers environment `spec` names (loaded once per process); one ConfigError line naming
    agent.environment when it is unset, not installed, its loader raises or returns something else."""
    if not spec:
        raise ConfigError("config key 'agent.environment': rows with agent_name 'verifiers' need it "
                          "(an installed environment's id, or 'package.module:load_environment')")
    key = _key(spec, args)
    if key in _ENVIRONMENTS:
        return _ENVIRONMENTS[key]
    try:
        import verifiers as vf
    except ImportError as exc:
        raise ConfigError(f"config key 'agent.environment': needs the verifiers package ({one_line(exc)}; pip install 'raytool[verifiers]')") from None
    try:
        with _process_signals_kept():
            if ":" in spec:
                from raytool.imports import import_object

                env = import_object(spec, "agent.environment")(**args)
            else:
                env = vf.load_environment(spec, **args)
    except ConfigError:
        raise
    except Exception as exc:  # not installed, or the environment's own loader failed
        raise ConfigError(f"config key 'agent.environment': loading {spec!r} failed ({one_line(exc)})") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"config key 'agent.environment': {spec!r} returned {type(env).__name__}, not a verifiers Environment")
    if getattr(env, "message_type", "chat") != "chat":
        raise ConfigError(f"config key 'agent.environment': {spec!r} is a {env.message_type!r} environment; raytool runs chat environments")
    if getattr(env.rubric, "has_advantages", False):
        raise ConfigError(f"config key 'agent.environment': {spec!r}'s rubric computes its own advantages; raytool's algorithm computes them "
                          "(algorithm.adv_estimator): use a rubric that scores")
    _guard_rubric(env.rubric)
    _ENVIRONMENTS[key] = env
    return env


def source_name(spec: str) -> str:
    """The data source of an environment's rows: `verifiers:` and its id, or its file's stem and
    function (metric keys are split at '/': a path would break them)."""
    module, sep, name = spec.rpartition(":")
    if sep and module.endswith(".py"):
        return f"verifiers:{Path(module).stem}:{name}"
    return "verifiers:" + spec.split("/")[-1]


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    raise ConfigError(f"{where}: message content that is not text ({type(content).__name__}) is not supported")


def environment_rows(spec: str, args: dict, split: str, limit: int | None = None) -> list:
    """PromptRows of the environment's `split` ('train': its dataset; 'eval': its eval dataset, none
    when it has none), each rolled out by the verifiers loop."""
    from raytool.data.prompts import PromptRow

    env = load_environment(spec, args)
    if split == "eval" and env.eval_dataset is None and getattr(env, "eval_dataset_source", None) is None:
        return []
    try:
        dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    except Exception as exc:
        raise ConfigError(f"config key 'agent.environment': {spec!r} has no usable {split} dataset ({one_line(exc)})") from None
    rows = []
    for i, item in enumerate(dataset):
        if limit is not None and i >= limit:
            break
        where = f"environment {spec!r} {split} row {i}"
        prompt = item.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise ConfigError(f"{where}: its prompt is not a list of messages")
        messages = [Message(m["role"], _text(m.get("content"), where)) for m in prompt]
        info = item.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info) if info.strip() else {}
        extra = {"example_id": item.get("example_id", i), "info": info}
        if item.get("task") is not None:
            extra["task"] = item["task"]
        rows.append(PromptRow(prompt=messages, ground_truth=str(item.get("answer") or ""), data_source=source_name(spec),
                              agent_name="verifiers", extra_info=extra, origin=where))
    return rows


def _role(message) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _content(message):
    return message.get("content") if isinstance(message, dict) else getattr(message, "content", None)


def last_answer(completion) -> str | None:
    """The text of the last assistant message of a verifiers completion (None: it has none)."""
    for message in reversed(completion or []):
        if _role(message) == "assistant":
            content = _content(message)
            return content if isinstance(content, str) else "" if content is None else str(content)
    return None


@register_agent_loop("verifiers")
class VerifiersAgentLoop:
    row_extra = True  # run() is given the row's extra (its extra_info: the environment's example_id, info, task)

    @staticmethod
    def check_environment(agent: AgentConfig) -> None:
        """Before any actor starts (raytool.agent.registry.check_agents): the environment loads, once."""
        load_environment(agent.environment, dict(agent.environment_args))

    def __init__(self, renderer: ChatRenderer, tools: dict, generate, agent: AgentConfig, rollout: RolloutConfig):
        self.env = load_environment(agent.environment, dict(agent.environment_args))
        self.renderer, self.generate, self.agent, self.rollout = renderer, generate, agent, rollout

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str, extra: dict | None = None) -> Trajectory:
        import verifiers as vf
        from verifiers.clients import OpenAIChatCompletionsClient

        row = (extra or {}).get("extra_info") or {}
        rec = await recording(self.renderer, self.generate, self.agent, self.rollout, messages, uid, group_id, ground_truth)
        client = OpenAIChatCompletionsClient(rec.client)
        example = {"prompt": [{"role": m.role, "content": m.content} for m in messages], "answer": ground_truth,
                   "example_id": int(row.get("example_id", 0)), "info": row.get("info") or {}}
        if row.get("task") is not None:
            example["task"] = row["task"]
        state, finish, error, infra = None, "", "", ""
        try:
            # Sampling is the run's (the gateway applies rollout.*): the environment's own sampling args are not sent.
            state = await asyncio.wait_for(self.env.rollout(example, client, MODEL_NAME, {}), self.agent.max_trajectory_s)
            failure = state.get("error")
            if isinstance(failure, vf.InfraError):
                infra = f"env: {first_line(failure)}"
            elif failure is not None:
                finish, error = "env_error", first_line(failure)
        except asyncio.TimeoutError:
            finish = TIME_LIMIT
        except Exception as exc:  # the environment itself failed: not the policy's doing
            infra = f"env: {first_line(exc)}"
        traj = rec.finish(last_answer(state.get("completion")) if state is not None else None)
        if traj.infra_failure:
            return traj
        if infra:
            traj.infra_failure, traj.finish_reason = infra, "infra_failed"
        elif state is None:  # timed out: no state to score, nothing to train on as the environment's
            traj.finish_reason = finish
        else:
            if finish:
                traj.finish_reason, traj.agent_error = finish, error
            _STATES[uid] = (self.env, state)
        return traj

    @staticmethod
    async def score_group(trajs: list[Trajectory], timeout_s: float) -> None:
        """Score the group's rolled-out trajectories with their environment's rubric, together; the
        rest (infra-failed, timed out) are not scored. A rubric that fails infra-fails them all."""
        held = [(t, _STATES.pop(t.uid)) for t in trajs if t.uid in _STATES]
        if not held:
            return
        env = held[0][1][0]
        states = [state for _, (_, state) in held]
        failures: list[str] = []
        token = _FAILURES.set(failures)
        try:
            await asyncio.wait_for(env.rubric.score_group(states), timeout_s)
            bad = [r for r in (state.get("reward") for state in states) if not _number(r)]
            cause = (f"reward function {failures[0]}" if failures  # verifiers scored a failed function 0.0: that is no score
                     else f"the rubric's reward is {bad[0]!r}, not a finite number" if bad else "")
        except asyncio.TimeoutError:
            cause = f"no score within reward.call_timeout_s={timeout_s:g}s"
        except Exception as exc:
            cause = first_line(exc)
        finally:
            _FAILURES.reset(token)
            for state in states:
                try:
                    await env.rubric.cleanup(state)
                except Exception as exc:  # a cleanup handler's failure does not undo the scores
                    log.warning("the environment's rubric cleanup failed: %s", first_line(exc))
        if cause:
            log.warning("scoring group %s with the environment's rubric failed: %s", trajs[0].group_id, cause)
            for t, _ in held:
                t.infra_failure, t.finish_reason = f"env rubric: {cause}", "infra_failed"
            return
        for (t, _), state in zip(held, states):
            t.reward = float(state["reward"])
            t.reward_extra = {name: float(v) for name, v in dict(state.get("metrics") or {}).items() if _number(v)}

    @staticmethod
    def forget(uids: list[str]) -> None:
        """Drop what is held for trajectories whose group will not be scored (a failed gather)."""
        for uid in uids:
            _STATES.pop(uid, None)
