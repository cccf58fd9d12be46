"""Agent loops by name: a dataset row's `agent_name` picks the loop that rolls it out.

A loop is a class constructed as `Loop(renderer, tools, generate, agent_cfg, rollout_cfg)` with
`async run(messages, ground_truth, uid, group_id) -> Trajectory`. Register your own with
`@register_agent_loop("my_agent")` in a module the agent workers import (name it in
`agent.loop_modules`), and give rows `agent_name: my_agent`. Optional, on the class: with
`row_extra = True`, `run` is also given the row's `extra=` (its data_source and extra_info); a
static `async score_group(trajs, timeout_s)` scores each group when all its rollouts are done
(instead of reward.fn, as the verifiers loop's rubric does), `forget(uids)` drops what it held
for a group that will not be scored, and `scored_by_environment = True` says `run` set the reward
itself (the openenv loop: the environment's step rewards), so reward.fn is not called;
`check_environment(agent_cfg)` checks the loop's environment before any actor starts. These are
read once, where the loop is registered (`loop_hooks`); a public name close to one of them (a
misspelled hook, which would silently do nothing) is refused there, naming the hook it resembles.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from raytool.config import AgentConfig, ConfigError
from raytool.errors import did_you_mean, one_line

AGENT_LOOPS: dict[str, type] = {}

# The optional hooks a loop class may have (see the module's docstring), and nothing else by these names.
HOOKS = ("row_extra", "scored_by_environment", "score_group", "forget", "check_environment")


@dataclass(frozen=True)
class LoopHooks:
    """What a loop class declares beyond `run`, read once where it is registered."""

    row_extra: bool = False  # run() takes the row's extra=
    scored_by_environment: bool = False  # run() set the reward: reward.fn is not called
    score_group: Callable[[list, float], Awaitable[None]] | None = None  # scores a whole group (instead of reward.fn)
    forget: Callable[[list[str]], None] | None = None  # drops what it held for a group that will not be scored
    check_environment: Callable[[AgentConfig], None] | None = None  # checks its environment before any actor starts

    @property
    def scored_by_loop(self) -> bool:
        return self.scored_by_environment or self.score_group is not None


def _hooks(name: str, cls: type) -> LoopHooks:
    """The hooks `cls` declares; a public name close to a hook's but not one (a misspelling, which
    would silently fall back to the default) is an error, as is a loop without an async `run`."""
    if not inspect.iscoroutinefunction(getattr(cls, "run", None)):
        raise ValueError(f"agent loop '{name}' ({cls.__module__}.{cls.__qualname__}) has no `async def run(messages, ground_truth, uid, group_id)`")
    for attr in dir(cls):
        if attr.startswith("_") or attr in HOOKS:
            continue
        close = difflib.get_close_matches(attr, HOOKS, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"agent loop '{name}' ({cls.__module__}.{cls.__qualname__}): {attr!r} is no hook (did you mean {close[0]!r}?); "
                             f"the hooks: {', '.join(HOOKS)}")
    return LoopHooks(bool(getattr(cls, "row_extra", False)), bool(getattr(cls, "scored_by_environment", False)),
                     getattr(cls, "score_group", None), getattr(cls, "forget", None), getattr(cls, "check_environment", None))


def register_agent_loop(name: str):
    def add(cls: type) -> type:
        if name in AGENT_LOOPS and AGENT_LOOPS[name] is not cls:
            raise ValueError(f"agent loop '{name}' is already registered (by {AGENT_LOOPS[name].__module__}.{AGENT_LOOPS[name].__name__})")
        LOOP_HOOKS[cls] = _hooks(name, cls)
        AGENT_LOOPS[name] = cls
        return cls

    return add


LOOP_HOOKS: dict[type, LoopHooks] = {}


def loop_hooks(cls: type) -> LoopHooks:
    """The hooks of a registered loop class."""
    return LOOP_HOOKS[cls]


# Built-in loops live in modules imported on first use (langgraph's needs an optional extra).
BUILTIN = {"tool_agent": "raytool.agent.loop", "langgraph": "raytool.agent.langgraph_loop", "openai": "raytool.agent.openai_loop",
           "verifiers": "raytool.agent.verifiers_loop", "openenv": "raytool.agent.openenv_loop"}


def get_agent_loop(name: str) -> type:
    if name not in AGENT_LOOPS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    try:
        return AGENT_LOOPS[name]
    except KeyError:
        raise ValueError(f"unknown agent loop '{name}'; registered: {sorted(AGENT_LOOPS)} "
                         "(register yours with raytool.agent.registry.register_agent_loop and list its module in agent.loop_modules)") from None


def check_agents(agent: AgentConfig, rows) -> None:
    """Before any actor starts: the loop modules import, the default loop and every row's
    `agent_name` (rows: PromptRows, named by their origin) name a loop, and the functions the
    openai and langgraph loops run import. One ConfigError line naming the key, or the file and row."""
    from raytool.imports import required_object

    for module in agent.loop_modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ModuleNotFoundError, or the module's own failure while importing
            raise ConfigError(f"config key 'agent.loop_modules': cannot import {module!r} ({one_line(exc)})") from None
    known = sorted(set(AGENT_LOOPS) | set(BUILTIN))
    if agent.default_agent not in known:
        raise ConfigError(f"config key 'agent.default_agent': no agent loop '{agent.default_agent}'{did_you_mean(agent.default_agent, known)}; "
                          f"the loops: {', '.join(known)} (register yours in a module named in agent.loop_modules)")
    used = {agent.default_agent}
    for i, row in enumerate(rows):
        if row.agent_name is None:
            continue
        if row.agent_name not in known:
            where = row.origin or f"prompt row {i}"
            raise ConfigError(f"{where}: agent_name '{row.agent_name}' is no agent loop{did_you_mean(row.agent_name, known)}; "
                              f"the loops: {', '.join(known)} (register yours in a module named in agent.loop_modules)")
        used.add(row.agent_name)
    for name in sorted(used & set(BUILTIN)):
        try:
            get_agent_loop(name)
        except ImportError as exc:  # langgraph's loop needs its optional extra
            raise ConfigError(f"agent loop '{name}' cannot be used here: {one_line(exc)}") from None
    if "openai" in used:
        required_object(agent.openai_agent, "agent.openai_agent", "openai")
    if "langgraph" in used:
        required_object(agent.langgraph_graph, "agent.langgraph_graph", "langgraph")
    if "verifiers" in used and "openenv" in used:
        raise ConfigError("config key 'agent.environment': rows with agent_name verifiers and rows with agent_name openenv would share "
                          "the one environment it names: give one of the two kinds of rows")
    # A loop of an environment (verifiers, openenv) checks it now, so a missing one stops the run
    # before any actor starts; the loops are found by name, so this module imports none of them.
    checks = [hooks.check_environment for hooks in (loop_hooks(get_agent_loop(name)) for name in sorted(used)) if hooks.check_environment]
    for check in checks:
        check(agent)
    if agent.environment and not checks:
        raise ConfigError(f"config key 'agent.environment': {agent.environment!r} rolls out no row (no row has agent_name verifiers or openenv): "
                          "set data.task verifiers for a verifiers environment's own dataset, or agent.default_agent verifiers or openenv")
