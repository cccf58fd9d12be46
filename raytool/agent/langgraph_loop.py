"""The `langgraph` agent loop: a user's LangGraph agent, rolled out through raytool's engines.

Rows with `agent_name: langgraph` are run by the agent that `agent.langgraph_graph` names
(`module:function`, called with a chat model, returning a compiled graph such as
`langgraph.prebuilt.create_react_agent(model, tools=[...])`). The model is
`RaytoolChatModel`: every LLM call is one token-level generate on the rollout servers, recorded
token-exactly (generated ids verbatim, everything else masked). Needs `pip install 'raytool[langgraph]'`.
"""

from __future__ import annotations

import asyncio

from raytool.agent.registry import register_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, RolloutConfig
from raytool.imports import required_object
from raytool.types import TIME_LIMIT, Message, Trajectory


@register_agent_loop("langgraph")
class LangGraphAgentLoop:
    def __init__(self, renderer: ChatRenderer, tools: dict, generate, agent: AgentConfig, rollout: RolloutConfig):
        self.make_graph = required_object(agent.langgraph_graph, "agent.langgraph_graph", "langgraph")
        self.renderer, self.generate, self.agent, self.rollout = renderer, generate, agent, rollout

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str) -> Trajectory:
        from raytool.agent.langchain_adapter import RaytoolChatModel, run_langgraph_agent

        r = self.rollout
        model = RaytoolChatModel(
            generate_fn=self.generate, renderer=self.renderer, session=uid, max_tokens=r.max_tokens_per_turn,
            max_response_tokens=self.agent.max_response_tokens, on_history_rewrite=self.agent.on_history_rewrite, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=r.seed,
        )
        # A ReAct step is a model call plus a tool call: max_turns model calls fit 2 * max_turns + 1 steps.
        run = run_langgraph_agent(self.make_graph, messages, model=model, group_id=group_id, ground_truth=ground_truth,
                                  recursion_limit=2 * self.agent.max_turns + 1)
        try:
            return await asyncio.wait_for(run, self.agent.max_trajectory_s)
        except asyncio.TimeoutError:
            traj = model.recorder.to_trajectory(uid, group_id, messages, ground_truth)
            traj.finish_reason = TIME_LIMIT
            return traj
