"""Agent loops by name: a dataset row's `agent_name` picks the loop that rolls it out.

A loop is a class constructed as `Loop(renderer, tools, generate, agent_cfg, rollout_cfg)` with
`async run(messages, ground_truth, uid, group_id) -> Trajectory`. Register your own with
`@register_agent_loop("my_agent")` in a module the agent workers import (name it in
`agent.loop_modules`), and give rows `agent_name: my_agent`.
"""

from __future__ import annotations

import importlib

AGENT_LOOPS: dict[str, type] = {}


def register_agent_loop(name: str):
    def add(cls: type) -> type:
        if name in AGENT_LOOPS and AGENT_LOOPS[name] is not cls:
            raise ValueError(f"agent loop '{name}' is already registered (by {AGENT_LOOPS[name].__module__}.{AGENT_LOOPS[name].__name__})")
        AGENT_LOOPS[name] = cls
        return cls

    return add


# Built-in loops live in modules imported on first use (langgraph's needs an optional extra).
BUILTIN = {"tool_agent": "raytool.agent.loop", "langgraph": "raytool.agent.langgraph_loop", "openai": "raytool.agent.openai_loop"}


def get_agent_loop(name: str) -> type:
    if name not in AGENT_LOOPS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    try:
        return AGENT_LOOPS[name]
    except KeyError:
        raise ValueError(f"unknown agent loop '{name}'; registered: {sorted(AGENT_LOOPS)} "
                         "(register yours with raytool.agent.registry.register_agent_loop and list its module in agent.loop_modules)") from None
