"""A LangGraph ReAct agent trained through the chat-model adapter: tokens exactly as generated, the rest masked."""

import asyncio
import copy
import json

import pytest

pytest.importorskip("langgraph")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

from raytool.agent.langchain_adapter import (  # noqa: E402
    HISTORY_REWRITTEN, RaytoolChatModel, render_chat, run_langgraph_agent, to_chat_dict,
)
from raytool.agent.render import ChatRenderer  # noqa: E402
from raytool.types import Message, TokenOutput  # noqa: E402

# create_react_agent moved to `langchain.agents.create_agent` (another package); it still works.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")

# ChatML with tools: the tool schemas in the system turn; an assistant turn is its content, then its
# `tool_calls` serialized (as Qwen's template does; the adapter's own turns carry none, or the calls
# would appear twice and the recording would stop); each tool message its own `tool` turn
# (consecutive ones are not merged).
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ 'You may call these tools, one JSON object each inside <tool_call></tool_call>:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message.role == 'system') %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '<tool_call>' + call.function | tojson + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tool_renderer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return ChatRenderer(tok)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


TURNS = [
    "First 17 + 25.\n" + call("add", a=17, b=25),
    "Now add 100.\n" + call("add", a=42, b=100),
    "The answer is 142.",
]
PROMPT = [SystemMessage("You are a calculator."), HumanMessage("What is 17 + 25 + 100?")]


def scripted(renderer, turns, per_char=False):
    """A fake engine: the tokenizer's ids of each scripted turn plus eos, log-prob -0.5 each.
    `per_char`: one token per character, a tokenization the tokenizer itself would never produce."""
    prompts, generated = [], []

    async def generate(prompt_ids, sampling, request_id, session):
        text = turns[len(prompts)]
        ids = [i for ch in text for i in renderer.encode(ch)] if per_char else renderer.encode(text)
        ids.append(renderer.eos_id)
        prompts.append(list(prompt_ids))
        generated.append(ids)
        return TokenOutput(ids, [-0.5] * len(ids), "stop", policy_version=3)

    return generate, prompts, generated


def run_agent(renderer, turns, per_char=False, **agent_kwargs):
    generate, prompts, generated = scripted(renderer, turns, per_char)
    model = RaytoolChatModel(generate_fn=generate, renderer=renderer, session="t0")
    agent = create_react_agent(model, tools=[add], **agent_kwargs)
    result = asyncio.run(agent.ainvoke({"messages": PROMPT}))
    return model, result["messages"], prompts, generated


def segments(mask):
    """[(start, end, value)] runs of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def test_react_agent_is_recorded_token_exact(tool_renderer):
    model, messages, prompts, generated = run_agent(tool_renderer, TURNS)
    tok = tool_renderer.tokenizer
    traj = model.recorder.to_trajectory("t0", "g0", messages, "142")

    assert messages[-1].content == TURNS[-1]
    tool_outputs = [m for m in messages if isinstance(m, ToolMessage)]
    assert [m.content for m in tool_outputs] == ["42", "142"]  # the tool really ran
    assert [m.tool_call_id for m in tool_outputs] == ["call_0", "call_1"]

    gen_ids = [i for turn in generated for i in turn]
    assert sum(traj.response_mask) == len(gen_ids)
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m == 1] == gen_ids
    assert {lp for lp, m in zip(traj.rollout_logprobs, traj.response_mask) if m == 1} == {-0.5}
    assert {lp for lp, m in zip(traj.rollout_logprobs, traj.response_mask) if m == 0} == {0.0}
    assert len(traj.rollout_logprobs) == len(traj.response_ids) == len(traj.response_mask)

    # prompt + response is the template's rendering of the whole conversation, tools included,
    # up to the last turn's eos (the template's trailing newline is nobody's token)
    schemas = [convert_to_openai_tool(add)]
    full = tok.apply_chat_template([to_chat_dict(m) for m in messages], tools=schemas, tokenize=False)
    assert tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False) + "\n" == full
    assert '"name": "add"' in tok.decode(traj.prompt_ids)

    # the observation segments are the tool outputs' turns, between the eos and the next assistant turn
    obs = [tok.decode(traj.response_ids[a:b]) for a, b, v in segments(traj.response_mask) if v == 0]
    assert obs == [f"\n<|im_start|>tool\n{out}<|im_end|>\n<|im_start|>assistant\n" for out in ("42", "142")]

    # the engine was given exactly the recorded ids, never a re-tokenization
    ids = traj.prompt_ids + traj.response_ids
    for prompt in prompts:
        assert ids[: len(prompt)] == prompt
    assert prompts[0] == traj.prompt_ids

    assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (3, 2, 0)
    assert (traj.finish_reason, traj.policy_version) == ("answer", 3)
    assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert traj.messages[2].content == TURNS[0]


def test_generated_ids_are_kept_even_when_not_the_canonical_tokenization(tool_renderer):
    # Real samplers emit such ids; re-tokenizing the text would train on tokens never sampled.
    model, messages, prompts, generated = run_agent(tool_renderer, TURNS, per_char=True)
    traj = model.recorder.to_trajectory("t0", "g0", messages, "142")

    assert generated[0] != tool_renderer.encode(TURNS[0]) + [tool_renderer.eos_id]
    assert traj.finish_reason == "answer" and model.recorder.rewrites == 0
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m == 1] == sum(generated, [])
    assert prompts[2] == traj.prompt_ids + traj.response_ids[: len(prompts[2]) - len(traj.prompt_ids)]


def test_rewritten_history_stops_recording(tool_renderer):
    def trim(state):  # a middleware that keeps the prompt and only the last tool round
        msgs = state["messages"]
        return {"llm_input_messages": msgs[:2] + msgs[-2:] if len(msgs) > 4 else msgs}

    model, messages, prompts, generated = run_agent(tool_renderer, TURNS, pre_model_hook=trim)
    traj = model.recorder.to_trajectory("t0", "g0", messages, "142")

    assert messages[-1].content == TURNS[-1]  # the agent itself ran as written
    assert traj.finish_reason == HISTORY_REWRITTEN and model.recorder.rewrites == 1
    # recording stopped before the third call: two turns and the observation between them, nothing else
    assert traj.num_turns == 2
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m == 1] == generated[0] + generated[1]
    assert traj.prompt_ids + traj.response_ids == prompts[1] + generated[1]
    # the third call was served from the agent's own (trimmed) history, unrecorded
    trimmed = render_chat(tool_renderer.tokenizer, [to_chat_dict(m) for m in PROMPT + messages[4:6]],
                          [convert_to_openai_tool(add)])
    assert prompts[2] == tool_renderer.encode(trimmed)


def test_malformed_tool_call_ends_the_agent_with_the_text_kept(tool_renderer):
    bad = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
    model, messages, _, generated = run_agent(tool_renderer, [bad])
    traj = model.recorder.to_trajectory("t0", "g0", messages, "")

    assert messages[-1].content == bad and messages[-1].tool_calls == []
    assert (traj.tool_calls, traj.tool_errors, traj.finish_reason) == (1, 1, "answer")
    assert traj.response_ids == generated[0]


def test_response_budget_ends_the_agent(tool_renderer):
    generate, prompts, generated = scripted(tool_renderer, TURNS)
    first = len(tool_renderer.encode(TURNS[0])) + 1
    model = RaytoolChatModel(generate_fn=generate, renderer=tool_renderer, session="t1", max_response_tokens=first + 3)
    messages = [Message("system", "You are a calculator."), Message("user", "What is 17 + 25 + 100?")]
    make_agent = lambda m: create_react_agent(m, tools=[add])  # noqa: E731
    traj = asyncio.run(run_langgraph_agent(make_agent, messages, model=model, group_id="g1"))

    assert len(prompts) == 1  # the observation did not fit: no second generation
    assert traj.response_ids == generated[0] and traj.finish_reason == "length"
    assert (traj.uid, traj.group_id, traj.messages[-1]) == ("t1", "g1", Message("assistant", ""))


def test_sync_invoke_says_to_use_ainvoke(tool_renderer):
    generate, _, _ = scripted(tool_renderer, TURNS)
    model = RaytoolChatModel(generate_fn=generate, renderer=tool_renderer, session="t2")
    with pytest.raises(NotImplementedError, match="ainvoke"):
        model.invoke([HumanMessage("hi")])


def test_assistant_messages_not_generated_here_render_their_tool_calls(tool_renderer):
    few_shot = AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "x"}])
    fn = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert to_chat_dict(few_shot) == {"role": "assistant", "content": "",
                                      "tool_calls": [{"id": "x", "type": "function", "function": fn}]}
    text = render_chat(tool_renderer.tokenizer, [to_chat_dict(m) for m in [*PROMPT, few_shot]], None)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text


def make_calculator_agent(model):
    """What a user names in agent.langgraph_graph: their agent, built on the chat model given."""
    return create_react_agent(model, tools=[add])


def test_rows_with_agent_name_langgraph_run_the_configured_graph(tool_renderer):
    from raytool.agent.registry import get_agent_loop
    from raytool.config import AgentConfig, RolloutConfig

    generate, prompts, generated = scripted(tool_renderer, TURNS)
    agent = AgentConfig(langgraph_graph=f"{__name__}:make_calculator_agent", max_turns=4)
    loop = get_agent_loop("langgraph")(tool_renderer, {}, generate, agent, RolloutConfig())
    traj = asyncio.run(loop.run([Message("system", "You are a calculator."), Message("user", "What is 17 + 25 + 100?")], "142", "t9", "g9"))
    assert traj.finish_reason == "answer" and traj.num_turns == 3
    assert sum(traj.response_mask) == sum(len(g) for g in generated)
    assert [t for t, m in zip(traj.response_ids, traj.response_mask) if m] == [t for g in generated for t in g]
