"""The `openai` agent loop: a user's agent written against the OpenAI API, rolled out and recorded.

Rows with `agent_name: openai` run the function `agent.openai_agent` names (`module:function` or
`path/to/file.py:function`):

    async def agent(client: openai.AsyncOpenAI, row: dict) -> str

`client` is a real `openai.AsyncOpenAI` whose base URL is the trajectory's own URL on a gateway in
this agent worker (`raytool.agent.gateway`), so every call it makes is one generate on the rollout
servers, recorded token-exactly. `row` has the prompt `messages` (role/content dicts), `model`
(the name to pass), `ground_truth`, `uid` and `group_id`. The agent runs its own tools; the string
it returns is the answer the reward reads (the conversation's last assistant message). An agent
that raises ends its trajectory (finish reason `agent_error`, the exception's first line in
`Trajectory.agent_error`) and the run goes on; one that runs past `agent.max_trajectory_s` ends
with `time_limit`. A generate call that failed (the gateway answered 500) makes the trajectory
`infra_failed`, whatever the agent did with that error: its group is rolled out again. Needs the
`openai` package.
"""

from __future__ import annotations

import asyncio
import logging

from raytool.agent.gateway import Gateway
from raytool.agent.registry import register_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, RolloutConfig
from raytool.imports import required_object
from raytool.types import TIME_LIMIT, Message, Trajectory

MODEL_NAME = "raytool-policy"

_GATEWAYS: dict[tuple[int, int], tuple[Gateway, asyncio.Future]] = {}  # per (renderer, event loop): the gateway and its start
_HTTP: dict[int, object] = {}  # per event loop: one HTTP client for every trajectory's openai client (making one costs ~20 ms: its SSL context)

# Every call an agent makes would be an INFO line of the HTTP client's in the worker's log.
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def shared_http_client():
    """The openai SDK's default HTTP client, one per event loop, shared by every trajectory's AsyncOpenAI."""
    import openai

    key = id(asyncio.get_running_loop())
    if key not in _HTTP:
        _HTTP[key] = openai.DefaultAsyncHttpxClient()
    return _HTTP[key]


async def worker_gateway(renderer: ChatRenderer, agent: AgentConfig) -> Gateway:
    """This agent worker's gateway (one per renderer and event loop), started on loopback on first use."""
    key = (id(renderer), id(asyncio.get_running_loop()))
    entry = _GATEWAYS.get(key)
    if entry is None:
        gateway = Gateway(renderer, None, model_name=MODEL_NAME, template_kwargs=dict(agent.chat_template_kwargs), tool_format=agent.format)
        entry = _GATEWAYS[key] = (gateway, asyncio.ensure_future(gateway.start()))
    await asyncio.shield(entry[1])
    return entry[0]


class Recording:
    """One trajectory recorded by this worker's gateway: `client` is a real `openai.AsyncOpenAI` on
    the trajectory's own URL (every call one generate, recorded token-exactly); `finish(answer)`
    closes it into the Trajectory."""

    def __init__(self, gateway: Gateway, path: str, client, renderer: ChatRenderer, messages: list[Message], uid: str, group_id: str,
                 ground_truth: str):
        self.gateway, self.path, self.client, self.renderer = gateway, path, client, renderer
        self.messages, self.uid, self.group_id, self.ground_truth = messages, uid, group_id, ground_truth

    def finish(self, answer: str | None) -> Trajectory:
        traj = self.gateway.finish(self.path, self.uid, self.group_id, self.ground_truth, answer)
        if traj.prompt_ids == []:  # the agent never called the model: its prompt as the template renders it
            traj.prompt_ids = self.renderer.prompt_ids(self.messages)
        return traj


async def recording(renderer: ChatRenderer, generate, agent: AgentConfig, rollout: RolloutConfig, messages: list[Message], uid: str,
                    group_id: str, ground_truth: str) -> Recording:
    """A new trajectory on this worker's gateway, sampled as the run's rollout.* say."""
    import openai

    r, a = rollout, agent
    gateway = await worker_gateway(renderer, a)
    path = gateway.open(uid, generate, sampling=r.sampling(), seed=r.seed, max_response_tokens=a.max_response_tokens,
                        on_history_rewrite=a.on_history_rewrite)
    client = openai.AsyncOpenAI(base_url=gateway.url + path, api_key="raytool", max_retries=0, timeout=a.max_trajectory_s,
                                http_client=shared_http_client())
    return Recording(gateway, path, client, renderer, messages, uid, group_id, ground_truth)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@register_agent_loop("openai")
class OpenAIAgentLoop:
    def __init__(self, renderer: ChatRenderer, tools: dict, generate, agent: AgentConfig, rollout: RolloutConfig):
        self.fn = required_object(agent.openai_agent, "agent.openai_agent", "openai")
        self.renderer, self.generate, self.agent, self.rollout = renderer, generate, agent, rollout

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str) -> Trajectory:
        a = self.agent
        rec = await recording(self.renderer, self.generate, a, self.rollout, messages, uid, group_id, ground_truth)
        row = {"messages": [{"role": m.role, "content": m.content} for m in messages], "model": MODEL_NAME,
               "ground_truth": ground_truth, "uid": uid, "group_id": group_id}
        answer, finish, error = None, "", ""
        try:
            answer = await asyncio.wait_for(self.fn(rec.client, row), a.max_trajectory_s)
            if not isinstance(answer, str):
                raise TypeError(f"{a.openai_agent} returned {type(answer).__name__}, not the answer string")
        except asyncio.TimeoutError:
            finish = TIME_LIMIT
        except Exception as exc:  # the agent's own failure: its trajectory ends, the run goes on
            finish, error, answer = "agent_error", first_line(exc), None
        traj = rec.finish(answer)
        if finish and not traj.infra_failure:  # an agent that failed because generation did is not at fault
            traj.finish_reason, traj.agent_error = finish, error
        return traj
