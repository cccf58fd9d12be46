"""Bring your own agent: a LangChain chat model over raytool's token-level generate, for LangGraph agents.

An existing LangGraph agent (e.g. `create_react_agent(model, tools)`) is trained without rewriting
it: `RaytoolChatModel` renders the agent's messages with the chat template, asks the engine for
tokens and hands back an AIMessage, while its `TokenRecorder` keeps the trajectory as the engine saw it.

The recording (token-exact; a rewritten history stops it) is `raytool.agent.recorder`'s.

One model (and so one recorder) per trajectory. Needs the `langgraph` extra (langchain-core).
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Literal, Sequence

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import tool_call
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, model_validator

from raytool.agent.loop import request_seed
from raytool.agent.parsers import parse_hermes
from raytool.agent.recorder import HISTORY_REWRITTEN, render_chat
from raytool.agent.recorder import TokenRecorder as _Recorder

__all__ = ["HISTORY_REWRITTEN", "RAW_TEXT_KEY", "RaytoolChatModel", "TokenRecorder", "render_chat", "run_langgraph_agent", "to_chat_dict",
           "to_langchain_messages", "to_raytool_messages"]
from raytool.agent.render import ChatRenderer
from raytool.types import Message, SamplingParams, TokenOutput, Trajectory

log = logging.getLogger(__name__)

RAW_TEXT_KEY = "raytool_raw_text"  # AIMessage.response_metadata key of the turn's generated text


def _content_text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block["text"])
        else:
            raise ValueError(f"{type(message).__name__} has a non-text content block {block!r}; "
                             "a token-level chat template renders text only")
    return "".join(parts)


def to_chat_dict(message: BaseMessage) -> dict:
    """One LangChain message as the role dict a chat template reads.

    An AIMessage this model generated is its raw generated text and nothing else (its tool calls are
    already in that text); any other AIMessage carries OpenAI-style tool_calls for templates that render them.
    """
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _content_text(message)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _content_text(message)}
    if isinstance(message, AIMessage):
        raw = message.response_metadata.get(RAW_TEXT_KEY)
        if raw is not None:
            return {"role": "assistant", "content": raw}
        out: dict = {"role": "assistant", "content": _content_text(message)}
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                for c in message.tool_calls
            ]
        return out
    if isinstance(message, ToolMessage):
        out = {"role": "tool", "content": _content_text(message), "tool_call_id": message.tool_call_id}
        if message.name:
            out["name"] = message.name
        return out
    raise TypeError(f"cannot render a {type(message).__name__} ({message.type!r}) with a chat template; "
                    "expected SystemMessage, HumanMessage, AIMessage or ToolMessage")


def to_raytool_messages(messages: Sequence[BaseMessage | Message]) -> list[Message]:
    """A LangChain conversation as raytool Messages (what reward fns and traces see)."""
    out = []
    for m in messages:
        if not isinstance(m, Message):
            d = to_chat_dict(m)
            m = Message(d["role"], d["content"])
        out.append(m)
    return out


def to_langchain_messages(messages: Sequence[Message]) -> list[BaseMessage]:
    """A dataset row's prompt (system/user Messages) as LangChain messages."""
    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    if any(m.role not in kinds for m in messages):
        raise ValueError(f"prompt roles must be system/user/assistant, got {[m.role for m in messages]}")
    return [kinds[m.role](content=m.content) for m in messages]


class TokenRecorder(_Recorder):
    """raytool.agent.recorder's recorder, reading LangChain conversations."""

    def to_trajectory(self, uid: str, group_id: str, messages: Sequence[BaseMessage | Message], ground_truth: str, *,
                      failed_tools: int | None = None) -> Trajectory:
        if failed_tools is None:
            failed_tools = sum(isinstance(m, ToolMessage) and m.status == "error" for m in messages)
        return super().to_trajectory(uid, group_id, to_raytool_messages(messages), ground_truth, failed_tools=failed_tools)


class RaytoolChatModel(BaseChatModel):
    """A LangChain chat model whose every call is one token-level `generate` on raytool's engines.

    Async only (`ainvoke`, `graph.ainvoke`). Tool calls are read from the generated text in the
    Hermes format, <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
    """

    generate_fn: Callable[[list[int], SamplingParams, str, str], Awaitable[TokenOutput]]  # raytool.agent.loop.Generate
    renderer: ChatRenderer
    session: str  # the trajectory id: sticky routing session and request-id prefix
    recorder: TokenRecorder | None = Field(default=None)  # None: one from `renderer` and `max_response_tokens`
    max_tokens: int = 256  # per call
    max_response_tokens: int | None = None  # whole trajectory after the prompt; None: unbounded
    on_history_rewrite: Literal["truncate", "drop"] = "truncate"  # how a trajectory whose history the agent rewrote trains
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] | None = None  # None: the renderer's eos
    seed: int | None = None  # per-call seeds from (seed, session, call), as in AgentLoop
    tool_format: Literal["hermes"] = "hermes"
    cache: bool = False  # a cached answer would skip the engine and leave a hole in the recording

    @model_validator(mode="after")
    def _raytool_recorder(self) -> "RaytoolChatModel":
        if self.recorder is None:
            self.recorder = TokenRecorder(self.renderer, self.max_response_tokens, self.on_history_rewrite)
        return self

    @property
    def _llm_type(self) -> str:
        return "raytool"

    def bind_tools(self, tools: Sequence[dict | type | Callable | Any], *, tool_choice: str | None = None, **kwargs):
        """Bind tools: their OpenAI schemas go to the chat template, which lists them in the prompt."""
        if tool_choice not in (None, "auto"):
            raise ValueError(f"tool_choice={tool_choice!r} is not supported: token-level generation cannot force "
                             "a tool call; bind with tool_choice=None or 'auto'")
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs) -> ChatResult:
        raise NotImplementedError("RaytoolChatModel is async only: call `await model.ainvoke(...)` "
                                  "or `await graph.ainvoke(...)` instead of invoke")

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         *, tools: list[dict] | None = None, **kwargs) -> ChatResult:
        if kwargs:
            raise TypeError(f"RaytoolChatModel got unsupported call options {sorted(kwargs)}")
        rec = self.recorder
        rendered = render_chat(self.renderer.tokenizer, [to_chat_dict(m) for m in messages], tools)
        prompt = rec.next_prompt(rendered)
        if prompt is None:  # the response budget is spent: an empty answer ends a ReAct agent
            empty = AIMessage(content="", response_metadata={RAW_TEXT_KEY: "", "finish_reason": "length"})
            return ChatResult(generations=[ChatGeneration(message=empty)])
        left = rec.tokens_left()
        sampling = SamplingParams(
            max_tokens=self.max_tokens if left is None or rec.stopped else min(self.max_tokens, left),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=self.stop_token_ids or (self.renderer.eos_id,),
            stop=tuple(stop or ()),
            seed=request_seed(self.seed, self.session, rec.num_calls - 1),
        )
        out = await self.generate_fn(prompt, sampling, f"{self.session}-{rec.num_calls - 1}", self.session)
        text = rec.record(out)
        calls = parse_hermes(text).calls
        # Malformed calls stay in the text only (counted as tool errors); a turn with no well-formed
        # call is, to the agent, its answer.
        malformed = max(text.count("<tool_call>") - len(calls), 0)
        first = rec.tool_calls
        rec.count_tool_calls(len(calls), malformed)
        message = AIMessage(
            content=text,
            tool_calls=[tool_call(name=c.name, args=c.arguments, id=f"call_{first + i}") for i, c in enumerate(calls)],
            response_metadata={RAW_TEXT_KEY: text, "finish_reason": out.finish_reason, "model_name": "raytool"},
        )
        return ChatResult(generations=[ChatGeneration(message=message)])


async def run_langgraph_agent(make_graph: Callable[[RaytoolChatModel], Any], messages: Sequence[Message], *,
                              model: RaytoolChatModel, group_id: str = "", ground_truth: str = "",
                              recursion_limit: int = 25) -> Trajectory:
    """Build the agent on `model` (`make_graph(model)`), run it on a dataset prompt, return the recorded trajectory."""
    graph = make_graph(model)
    result = await graph.ainvoke({"messages": to_langchain_messages(messages)},
                                 config={"recursion_limit": recursion_limit})
    return model.recorder.to_trajectory(model.session, group_id, result["messages"], ground_truth)
