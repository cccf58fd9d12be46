"""The OpenAI-compatible gateway: the real `openai` client against it over HTTP on loopback, on
Qwen2.5-Instruct's own chat template (tests/fixtures/templates), with a scripted engine; the
trajectory it records is token-exact (see tests/integration/test_vllm_engine.py for vLLM)."""

import asyncio
import copy
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from helpers.scripted_chat import scripted

from raytool.agent.gateway import Gateway
from raytool.agent.recorder import HISTORY_REWRITTEN
from raytool.agent.render import ChatRenderer
from raytool.types import Message, SamplingParams, TokenOutput

MODEL = "raytool-policy"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}
PROMPT = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 17 + 25 + 100?"}]


def call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


TURNS = ["First 17 + 25.\n" + call("add", a=17, b=25), "Now add 100.\n" + call("add", a=42, b=100), "The answer is 142."]


async def calculator_agent(client, row):
    """A plain `openai` tool-calling agent: call, run the tools it asks for, until it answers."""
    messages = list(row["messages"])
    for _ in range(5):
        reply = await client.chat.completions.create(model=row["model"], messages=messages, tools=[ADD])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for c in message.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return ""


async def trimming_agent(client, row):
    """Drops its first exchange before the second call: a rewritten history."""
    messages = list(row["messages"])
    first = await client.chat.completions.create(model=row["model"], messages=messages, tools=[ADD])
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    await client.chat.completions.create(model=row["model"], messages=[messages[0], messages[1], {"role": "user", "content": "go on"}])
    return "142"


async def failing_agent(client, row):
    await client.chat.completions.create(model=row["model"], messages=row["messages"])
    raise RuntimeError("the agent's own bug\nsecond line")


def run_loop(renderer, agent_fn, **agent_options):
    from raytool.agent.registry import get_agent_loop
    from raytool.config import AgentConfig, RolloutConfig

    generate, prompts, generated = scripted(renderer, TURNS)
    agent = AgentConfig(openai_agent=f"{__name__}:{agent_fn}", **agent_options)
    loop = get_agent_loop("openai")(renderer, {}, generate, agent, RolloutConfig(max_tokens_per_turn=64))
    messages = [Message(m["role"], m["content"]) for m in PROMPT]
    return asyncio.run(loop.run(messages, "142", "g/0", "g")), prompts, generated


def test_an_openai_agent_is_recorded_token_exact_on_the_qwen_template(qwen):
    traj, prompts, generated = run_loop(qwen, "calculator_agent")
    tok = qwen.tokenizer
    assert (traj.finish_reason, traj.num_turns, traj.tool_calls, traj.policy_version) == ("answer", 3, 2, 2)
    gen = [i for g in generated for i in g]
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == gen  # exactly the generated ids, in order
    assert sum(traj.response_mask) == len(gen)
    assert {lp for lp, m in zip(traj.rollout_logprobs, traj.response_mask) if m} == {-0.5}
    # prompt + response is the template's rendering of the finished conversation, tools listed
    conversation = [*PROMPT, {"role": "assistant", "content": TURNS[0]}, {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
                    {"role": "assistant", "content": TURNS[1]}, {"role": "user", "content": "<tool_response>\n142\n</tool_response>"},
                    {"role": "assistant", "content": TURNS[2]}]
    full = tok.apply_chat_template(conversation, tools=[ADD], tokenize=False)
    assert tok.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False) + "\n" == full
    ids = traj.prompt_ids + traj.response_ids
    assert all(ids[: len(p)] == p for p in prompts)  # the engine got the recorded ids, never a re-tokenization
    assert traj.messages[-1] == Message("assistant", "The answer is 142.")  # the agent's return value: what the reward reads


def test_a_rewritten_history_ends_the_recording_and_trains_as_configured(qwen):
    truncated, _, generated = run_loop(qwen, "trimming_agent")
    assert truncated.finish_reason == HISTORY_REWRITTEN
    assert [i for i, m in zip(truncated.response_ids, truncated.response_mask) if m] == generated[0]  # the first turn only
    dropped, _, _ = run_loop(qwen, "trimming_agent", on_history_rewrite="drop")
    assert dropped.finish_reason == HISTORY_REWRITTEN and dropped.response_ids == truncated.response_ids and sum(dropped.response_mask) == 0


def test_an_agent_that_raises_ends_its_trajectory_with_the_first_line(qwen):
    traj, _, generated = run_loop(qwen, "failing_agent")
    assert (traj.finish_reason, traj.agent_error) == ("agent_error", "RuntimeError: the agent's own bug")
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == generated[0]


def test_a_failed_generate_makes_the_trajectory_infra_failed_not_the_agents_error(qwen):
    from raytool.agent.registry import get_agent_loop
    from raytool.config import AgentConfig, RolloutConfig

    async def generate(prompt_ids, sampling, request_id, session):
        raise RuntimeError("no rollout server left")

    loop = get_agent_loop("openai")(qwen, {}, generate, AgentConfig(openai_agent=f"{__name__}:calculator_agent"), RolloutConfig())
    traj = asyncio.run(loop.run([Message(m["role"], m["content"]) for m in PROMPT], "142", "f/0", "f"))
    assert (traj.finish_reason, traj.infra_failure, traj.agent_error) == ("infra_failed", "generate: RuntimeError: no rollout server left", "")


def test_the_api_serves_tool_calls_streaming_n_and_usage_and_errors_in_openais_shape(qwen):
    generate, prompts, generated = scripted(qwen, TURNS)

    async def main():
        gateway = Gateway(qwen, generate, model_name=MODEL, max_model_len=400, defaults=SamplingParams(max_tokens=64))
        url = await gateway.start()
        try:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                assert [m.id for m in (await client.models.list()).data] == [MODEL]
                # streaming: the message in chunks (content, then the tool call), and the usage
                stream = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=[ADD], stream=True,
                                                              stream_options={"include_usage": True})
                content, calls, finish, usage = "", [], None, None
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for ch in chunk.choices:
                        content += ch.delta.content or ""
                        calls += ch.delta.tool_calls or []
                        finish = ch.finish_reason or finish
                assert (content, finish) == ("First 17 + 25.", "tool_calls")
                assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("add", {"a": 17, "b": 25})]
                assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]), len(generated[0]))
                # n: one generate per choice (the scripted engine answers each with its next turn)
                reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=[ADD], n=2)
                first, second = reply.choices
                assert (first.finish_reason, first.message.content) == ("tool_calls", "Now add 100.")
                assert [(t.function.name, json.loads(t.function.arguments)) for t in first.message.tool_calls] == [("add", {"a": 42, "b": 100})]
                assert (second.finish_reason, second.message.content, second.message.tool_calls) == ("stop", "The answer is 142.", None)
                assert reply.usage.prompt_tokens == len(prompts[1]) == len(prompts[2])
                assert reply.usage.completion_tokens == len(generated[1]) + len(generated[2])

                with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
                    await client.chat.completions.create(model="gpt-4o", messages=PROMPT)
                with pytest.raises(openai.BadRequestError) as bad:
                    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 500}])
                assert bad.value.code == "context_length_exceeded" and "maximum context length is 400" in bad.value.message
                with pytest.raises(openai.BadRequestError, match="tool_choice"):
                    await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=[ADD], tool_choice="required")
                with pytest.raises(openai.BadRequestError, match=r"messages\[0\]"):
                    await client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])

            path = gateway.open("t0", generate)
            async with openai.AsyncOpenAI(base_url=url + path, api_key="x", max_retries=0) as client:
                with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
                    await client.chat.completions.create(model=MODEL, messages=PROMPT, n=2)
                await client.chat.completions.create(model=MODEL, messages=PROMPT)
                traj = gateway.finish(path, "t0", "g", "", None)
                assert traj.num_turns == 1
                with pytest.raises(openai.NotFoundError, match="no such trajectory"):  # finished: gone
                    await client.chat.completions.create(model=MODEL, messages=PROMPT)
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/chat/completions", data=b"{not json") as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
                async with http.get(url + "/traj/nope/v1/models") as r:
                    assert r.status == 404
        finally:
            await gateway.stop()

    asyncio.run(main())


def test_the_gateway_bench_runs_both_sides_on_the_same_conversation():
    from raytool.bench.gateway import bench
    from raytool.config import load_config

    table, result = bench(load_config(None, ["rollout.scripted_delay_s=0.01"]), trajectories=4, concurrency=2)
    assert result["response_tokens_native"] == result["response_tokens_gateway"] > 0  # the same conversation, token for token in length
    assert 0 < result["gateway_vs_native"] and 0 <= result["added_latency_p50_ms"] <= result["added_latency_p99_ms"]
    assert "gateway_vs_native" in table


def test_the_readme_openai_agent_runs_and_is_recorded(qwen):
    """The README's complete `openai` agent, as a module, through the `openai` agent loop."""
    import re
    import sys
    import types

    readme = (Path(__file__).parents[1] / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- openai-agent-example -->\s*```python\n(.*?)```", readme, re.DOTALL)
    module = types.ModuleType("readme_openai_agent")
    exec(compile(block.group(1), "README.md:openai-agent-example", "exec"), module.__dict__)
    sys.modules["readme_openai_agent"] = module
    try:
        from raytool.agent.registry import get_agent_loop
        from raytool.config import AgentConfig, RolloutConfig

        generate, prompts, generated = scripted(qwen, TURNS)
        loop = get_agent_loop("openai")(qwen, {}, generate, AgentConfig(openai_agent="readme_openai_agent:agent"), RolloutConfig())
        traj = asyncio.run(loop.run([Message(m["role"], m["content"]) for m in PROMPT], "142", "r/0", "r"))
    finally:
        del sys.modules["readme_openai_agent"]
    assert (traj.finish_reason, traj.num_turns, traj.tool_calls) == ("answer", 3, 2)
    assert traj.messages[-1].content == "The answer is 142."
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == [i for g in generated for i in g]


def test_a_trajectory_samples_at_the_runs_temperature_whatever_the_agent_asks(qwen):
    seen = []

    async def generate(prompt_ids, sampling, request_id, session):
        seen.append(sampling)
        return TokenOutput([qwen.eos_id], [-0.1], "stop")

    async def main():
        gateway = Gateway(qwen, generate, model_name=MODEL)
        url = await gateway.start()
        try:
            path = gateway.open("t", generate, sampling=SamplingParams(max_tokens=64, temperature=1.0, top_p=1.0))
            async with openai.AsyncOpenAI(base_url=url + path, api_key="x", max_retries=0) as client:
                await client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=0.0, top_p=0.5, max_tokens=9, stop=["END"])
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                await client.chat.completions.create(model=MODEL, messages=PROMPT, temperature=0.0, top_p=0.5)
        finally:
            await gateway.stop()

    asyncio.run(main())
    traj_call, plain_call = seen
    assert (traj_call.temperature, traj_call.top_p, traj_call.max_tokens, traj_call.stop) == (1.0, 1.0, 9, ("END",))
    assert (plain_call.temperature, plain_call.top_p) == (0.0, 0.5)  # interactive use: the request decides


def test_an_openai_agent_is_named_by_module_or_file_and_a_bad_name_is_one_line(tmp_path):
    from raytool.config import ConfigError
    from raytool.imports import import_object

    (tmp_path / "my_agents.py").write_text("async def agent(client, row):\n    return 'x'\n")
    assert import_object(f"{tmp_path / 'my_agents.py'}:agent", "agent.openai_agent").__name__ == "agent"
    assert import_object(f"{__name__}:calculator_agent", "agent.openai_agent") is calculator_agent
    for spec, why in [("no_colon", "expected 'package.module:function'"), (f"{tmp_path / 'absent.py'}:agent", "absent.py not found"),
                      (f"{tmp_path / 'my_agents.py'}:nope", "cannot import"), ("no_such_module:agent", "No module named")]:
        with pytest.raises(ConfigError, match=f"config key 'agent.openai_agent': .*{why}"):
            import_object(spec, "agent.openai_agent")


@pytest.mark.parametrize("fmt, turn", [
    ("llama3_json", '{"name": "add", "parameters": {"a": 17, "b": 25}}'),
    ("qwen3_coder", "First 17 + 25.\n<tool_call>\n<function=add>\n<parameter=a>\n17\n</parameter>\n<parameter=b>\n25\n</parameter>\n</function>\n</tool_call>"),
])
def test_the_gateway_reads_tool_calls_in_the_runs_format(qwen, fmt, turn):
    """agent.format is how the model writes calls: the gateway turns them into OpenAI tool_calls,
    the XML format's values typed from the request's tools (17, not "17")."""
    generate, _, _ = scripted(qwen, [turn])

    async def main():
        gateway = Gateway(qwen, generate, model_name=MODEL, tool_format=fmt)
        url = await gateway.start()
        try:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                reply = await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=[ADD])
        finally:
            await gateway.stop()
        return reply.choices[0]

    choice = asyncio.run(main())
    assert choice.finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [("add", {"a": 17, "b": 25})]
    assert choice.message.content == ("First 17 + 25." if fmt == "qwen3_coder" else None)
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        Gateway(qwen, generate, model_name=MODEL, tool_format="xml")


def test_a_formats_own_end_of_call_token_stops_the_gateways_generations(qwen):
    """Llama's <|eom_id|> ends a call turn as the loop's generations end there (agent.format
    llama3_json); a tokenizer without it samples to eos only."""
    tok = copy.deepcopy(qwen.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    asked = []

    async def generate(prompt_ids, sampling, request_id, session):
        asked.append(sampling.stop_token_ids)
        return TokenOutput([qwen.eos_id], [-0.5], "stop", policy_version=0)

    async def main(renderer, fmt):
        gateway = Gateway(renderer, generate, model_name=MODEL, tool_format=fmt)
        url = await gateway.start()
        try:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                await client.chat.completions.create(model=MODEL, messages=PROMPT)
        finally:
            await gateway.stop()

    for renderer, fmt in ((ChatRenderer(tok), "llama3_json"), (qwen, "llama3_json"), (qwen, "hermes")):
        asyncio.run(main(renderer, fmt))
    assert asked == [(qwen.eos_id, eom), (qwen.eos_id,), (qwen.eos_id,)]


def test_a_thinking_models_reasoning_comes_back_as_reasoning_content_and_the_recording_stays_exact(qwen):
    turn = "<think>\nSeventeen and twenty-five.\n</think>\n\nThe answer is 42."
    generate, prompts, generated = scripted(qwen, [turn, "Done."])

    async def main():
        gateway = Gateway(qwen, generate, model_name=MODEL)
        url = await gateway.start()
        try:
            path = gateway.open("t0", generate)
            async with openai.AsyncOpenAI(base_url=url + path, api_key="x", max_retries=0) as client:
                first = (await client.chat.completions.create(model=MODEL, messages=PROMPT)).choices[0].message
                history = [*PROMPT, {"role": "assistant", "content": first.content}, {"role": "user", "content": "Sure?"}]
                await client.chat.completions.create(model=MODEL, messages=history)
            return first, gateway.finish(path, "t0", "g", "", None)
        finally:
            await gateway.stop()

    first, traj = asyncio.run(main())
    assert (first.content, first.reasoning_content) == ("The answer is 42.", "Seventeen and twenty-five.")
    # The agent sent back the answer alone; the second prompt still extends what was generated.
    assert prompts[1][: len(prompts[0]) + len(generated[0])] == prompts[0] + generated[0]
    assert traj.num_turns == 2


@pytest.mark.parametrize("fmt, markers, turn", [
    ("kimi_k2", ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>"],
     "Adding.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{\"a\": 17, \"b\": 25}"
     "<|tool_call_end|><|tool_calls_section_end|>"),
    ("deepseek", ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"],
     "Adding.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 17, \"b\": 25}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
])
def test_a_format_whose_markers_are_special_tokens_is_parsed_from_them(qwen, fmt, markers, turn):
    """Kimi's and DeepSeek's call markers are special tokens of their tokenizers: the gateway reads
    the calls from the turn decoded with them, and the message's content is the text before them."""
    tok = copy.deepcopy(qwen.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": markers})
    renderer = ChatRenderer(tok)
    generate, _, generated = scripted(renderer, [turn, "42."])

    async def main():
        gateway = Gateway(renderer, generate, model_name=MODEL, tool_format=fmt)
        url = await gateway.start()
        try:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                return await client.chat.completions.create(model=MODEL, messages=PROMPT, tools=[ADD])
        finally:
            await gateway.stop()

    reply = asyncio.run(main())
    assert any(i >= len(qwen.tokenizer) for i in generated[0])  # the markers were single special tokens
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [("add", {"a": 17, "b": 25})]
