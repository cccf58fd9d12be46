"""The agent loop and SFT on the real chat templates of the models the recipes train.

Each template is the model's own `chat_template`, byte for byte (checked by sha256 below), set on
SmolLM2's tokenizer with the model's special and added tokens put in (the real vocabularies cannot
be downloaded here; what the tests check is the template's text and where its tokens split).

For every template and conversation shape the real `ToolAgentLoop` runs over a scripted engine and a
scripted sandbox, and the tests check against the template's own rendering:
- the loss mask is 1 on exactly the ids the engine generated, in order;
- every observation is exactly what the template writes after the turn it answers, in the fresh
  rendering of the conversation so far (what a chat server would have sent);
- every prompt the engine got, and the finished conversation, equal the template's rendering, token
  for token, except where the template rewrites what the model already saw; there the difference
  is the template's known rewrite (`REWRITES`) and nothing else;
- SFT on the conversation gives the tokens the rollout gives;
- the start-up probe reports the template's behaviour, naming the place.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytool.agent.loop import ToolAgentLoop
from raytool.agent.render import ChatRenderer, RenderError
from raytool.agent.turns import NEXT_ROLE_ENDS, TEMPLATE_TURN_ENDS, closes_itself, turn_text
from raytool.config import AgentConfig, RolloutConfig
from raytool.tools import CodeInterpreterTool
from raytool.types import ExecResult, Message, TokenOutput

FIXTURES = Path(__file__).parent / "fixtures" / "templates"


@dataclass(frozen=True)
class Template:
    file: str
    sha256: str
    eos: str
    special: tuple[str, ...] = ()  # special tokens of the model that SmolLM2's tokenizer lacks
    added: tuple[str, ...] = ()  # added (atomic, non-special) tokens of the model
    bos: str | None = None
    # The generation prompt ends in whitespace that SmolLM2's GPT-2-style pre-tokenizer splits
    # differently once text follows it ("\n\n" + "<" gives "\n", "\n", "<"; Llama 3's own
    # pre-tokenizer keeps "\n\n"): the engine's ids then differ from a re-tokenization of the whole
    # text at that one boundary, as token-in-token-out intends, and exactness is checked on the text.
    splits_after_generation_prompt: bool = False


_QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>")

TEMPLATES = {
    # Qwen/Qwen3-4B: the hybrid-thinking template of the Qwen3 dense models (current HF revision, with
    # `message.content is string` in its reverse scan). Vendored byte for byte by huggingface/trl,
    # trl/chat_templates/qwen3.jinja at f2cd57710ae345ea6428ae95363267fcf38a3dc8 (TRL's tests compare
    # it with the hub's tokenizer); the first 4,023 characters also match a Qwen3-4B-Thinking-2507
    # tokenizer_config.json copy (akougkas/warpio-cli), which differs only in its generation prompt.
    "qwen3": Template("qwen3.jinja", "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
                      "<|im_end|>", added=_QWEN3_ADDED),
    # Qwen/Qwen3-4B-Instruct-2507: huggingface/trl trl/chat_templates/qwen3_instruct_2507.jinja
    # (last changed in e5677dace3f8ab512ab40ba95fe8a887f5d37a45).
    "qwen3_instruct_2507": Template("qwen3_instruct_2507.jinja",
                                    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
                                    "<|im_end|>", added=_QWEN3_ADDED),
    # Qwen/Qwen2.5-32B-Instruct (the Qwen2.5-Instruct template): huggingface/trl
    # trl/chat_templates/qwen2_5.jinja; the same bytes as llama.cpp models/templates/
    # Qwen-Qwen2.5-7B-Instruct.jinja, huggingface.js's e2e fixture and axolotl's qwen_25.jinja.
    "qwen2_5_instruct": Template("qwen2_5_instruct.jinja", "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
                                 "<|im_end|>", added=("<tool_call>", "</tool_call>")),
    # meta-llama/Llama-3.1-8B-Instruct: huggingface/trl trl/chat_templates/llama3_1.jinja; the same
    # bytes as llama.cpp models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja and huggingface.js's
    # e2e fixture (fe42e68017ffc76d09922ea8f9b38a6964345710).
    "llama3_1_instruct": Template("llama3_1_instruct.jinja", "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
                                  "<|eot_id|>", special=_LLAMA3_SPECIAL, bos="<|begin_of_text|>",
                                  splits_after_generation_prompt=True),
    # NousResearch/Hermes-3-Llama-3.1-8B, its `tool_use` template: llama.cpp models/templates/
    # NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja at 1eeb523c3e0c7ffbd59469f5463dcbdecba3535e
    # (written by scripts/get_chat_template.py from the hub's tokenizer_config.json).
    "hermes3_tool_use": Template("hermes3_tool_use.jinja", "7ce09d55d3690e06c70b5c07228cc7e8c99c43a23cdc027762be4011efcdea6c",
                                 "<|im_end|>", special=("<|begin_of_text|>",), bos="<|begin_of_text|>",
                                 added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")),
    # The other families' own templates, each with its own call format (sources and sha256 in
    # test_families.py and docs/agents.md; Llama 3.1's own JSON calls run on its template above).
    "deepseek_v3_1": Template("deepseek_v3_1.jinja", "7fe7159748925dc7d9e2aaeb11e4bd3121c311d8d0e3a0d6377fb8550e64c560",
                              "<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", special=(
                                  "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
                                  "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
                                  "<｜tool▁output▁end｜>", "<think>", "</think>")),
    "qwen3_coder_vllm": Template("qwen3_coder_vllm.jinja", "5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06", "<|im_end|>", added=("<tool_call>", "</tool_call>")),
    "llama3_1_json": Template("llama3_1_instruct.jinja", "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
                              "<|eot_id|>", special=_LLAMA3_SPECIAL, bos="<|begin_of_text|>", splits_after_generation_prompt=True),
    # The two families whose templates take a turn in parts (raytool.agent.turns): the loop records
    # Kimi's reasoning as reasoning_content and both families' calls as tool_calls with their ids.
    "kimi_k2_thinking": Template("kimi_k2_thinking.jinja", "833d0c375531149a922a0f2addf9a66cce8e4503c500fe4ca6a95e9d1ed3c75a",
                                 "<|im_end|>", special=(
                                     "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                                     "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                     "<|tool_call_argument_begin|>", "<|tool_call_end|>"), added=("<think>", "</think>")),
    "gpt_oss_20b": Template("gpt_oss_20b.jinja", "3aff18eca7ee88d43372b19f7e3784fb15d1acd014f31fa2e71614d9453576fa", "<|return|>",
                            special=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")),
    # llama.cpp's adaptation of GLM-4.5's template (test_families.py says where from): its turns
    # end with the next role's token (<|observation|>, <|user|>), which the model generates.
    "glm_4_5": Template("glm_4_5_llamacpp.jinja", "0f25e04269293cd5dda8b73283c758817d28afea579ac30a5f95cd56f31a7447", "<|endoftext|>",
                        special=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
                        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                               "</arg_value>", "<tool_response>", "</tool_response>")),
    "mistral_small_3_1": Template("mistral_small_3_1.jinja", "773c8c8c2ffb59c8d1069fe423733d2007a88c52d0a838d89e6aae6693b97427",
                                  "</s>", bos="<s>", special=(
                                      "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                                      "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")),
}

EMPTY_THINK = "<think>\n\n</think>\n\n"


def _keep_last(text: str, old: str, new: str, finished: bool) -> str:
    """`old` replaced by `new` everywhere, except its last occurrence unless `finished`."""
    parts = text.split(old)
    if len(parts) == 1:
        return text
    head, last = parts[:-1], parts[-1]
    joined = new.join(head)
    return joined + (new if finished else old) + last


def _qwen3(text: str, finished: bool) -> str:
    """Qwen3 renders the LAST assistant turn with an empty <think> block when it has no reasoning, and
    no such block once later turns exist; the generation prompt carries one with enable_thinking=False."""
    text = _keep_last(text, EMPTY_THINK, "", finished=False)  # only the last one survives a re-render
    if finished:  # the finished conversation's last assistant turn, if it has no reasoning, gets one
        at = text.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
        if not text.startswith("<think>", at):
            text = text[:at] + EMPTY_THINK + text[at:]
    return text


def _hermes3(text: str, finished: bool) -> str:
    """Hermes-3 ends a tool turn with "</tool_response><|im_end|>" while it is the last message and with
    "</tool_response>\\n<|im_end|>" once anything follows it."""
    return _keep_last(text, "</tool_response><|im_end|>", "</tool_response>\n<|im_end|>", finished)


def _kimi(text: str, finished: bool) -> str:
    """Kimi-K2-Thinking keeps the reasoning of the turns after the last answer (a turn without calls);
    once the conversation ends on an answer, every turn is before it: all reasoning is dropped."""
    return re.sub(r"<think>.*?</think>", "<think></think>", text, flags=re.DOTALL) if finished else text


def _glm(text: str, finished: bool) -> str:
    """GLM's template writes nothing after the conversation's last turn, where the model ended it with <|user|>."""
    return text.removesuffix("<|user|>") if finished else text


def _gpt_oss(text: str, finished: bool) -> str:
    """gpt-oss's template writes a call the model ended with <|call|> ending in <|end|>."""
    return text.replace("<|call|>", "<|end|>")


# How each template renders what the model already saw (as generated, as observed), given the text
# the model saw; a template missing here must render it unchanged.
REWRITES = {"qwen3": _qwen3, "hermes3_tool_use": _hermes3, "kimi_k2_thinking": _kimi, "gpt_oss_20b": _gpt_oss, "glm_4_5": _glm}


@pytest.fixture(scope="module")
def tokenizers(tokenizer):
    """A tokenizer per template: SmolLM2's, with the model's tokens and chat template."""
    out = {}
    for name, t in TEMPLATES.items():
        tok = copy.deepcopy(tokenizer)
        if t.special:
            tok.add_special_tokens({"additional_special_tokens": list(t.special)})
        if t.added:
            tok.add_tokens(list(t.added))
        tok.eos_token = t.eos
        if t.bos:
            tok.bos_token = t.bos
        tok.chat_template = (FIXTURES / t.file).read_text()
        out[name] = tok
    return out


def test_the_templates_are_the_models_own_bytes():
    for name, t in TEMPLATES.items():
        data = (FIXTURES / t.file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == t.sha256, name


# --- conversations ------------------------------------------------------------------------------------


def call(expr: str) -> str:
    return f'<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({expr})"}}}}\n</tool_call>'


def code(expr: str) -> str:
    return f"<code>\n```python\nprint({expr})\n```\n</code>"


SYSTEM = Message("system", "You are a helpful assistant. Use the code interpreter.")
USER = Message("user", "What is 2 + 3?")


@dataclass(frozen=True)
class Scenario:
    prompt: tuple[Message, ...]
    turns: tuple[str, ...]  # what the engine generates, turn by turn
    format: str = "hermes"
    style: str = "tool_message"
    template_kwargs: tuple = ()


SCENARIOS = {
    "one_call": Scenario((SYSTEM, USER), (call("2 + 3"), "It is \\boxed{5}.")),
    "parallel_calls": Scenario((SYSTEM, USER), ("Two calls.\n" + call("2 + 3") + "\n" + call("3 + 2"), "Both say \\boxed{5}.")),
    "thinking": Scenario((SYSTEM, USER), ("<think>\nI should run it.\n</think>\n\n" + call("2 + 3"),
                                          "<think>\nIt printed 5.\n</think>\n\nIt is \\boxed{5}.")),
    "mixed_turns": Scenario((SYSTEM, USER), ("<think>\nFirst 2 + 3.\n</think>\n\n" + call("2 + 3"), "Check it.\n" + call("5 * 1"),
                                             "Checked: \\boxed{5}.")),
    "several_users": Scenario(
        (SYSTEM, Message("user", "What is 1 + 1?"), Message("assistant", "<think>\nEasy.\n</think>\n\nIt is 2."), USER),
        (call("2 + 3"), "<think>\nThe tool said 5.\n</think>\n\nIt is \\boxed{5}.")),
    "retool_tool_message": Scenario((SYSTEM, USER), ("Let me run it.\n" + code("2 + 3"), "It is \\boxed{5}."), format="retool"),
    "retool_in_turn": Scenario((SYSTEM, USER), ("Let me run it.\n" + code("2 + 3"), "So it is \\boxed{5}."),
                               format="retool", style="in_turn"),
    "no_thinking_mode": Scenario((SYSTEM, USER), (call("2 + 3"), "Check.\n" + call("5 * 1"), "It is \\boxed{5}."),
                                 template_kwargs=(("enable_thinking", False),)),
}


def _args(expr: str) -> str:
    return '{"code": "print(%s)"}' % expr


# Each family's calls as its models write them (what test_families.py's parsers read), by template.
def _mistral_calls(*exprs: str) -> str:
    items = [json.dumps({"name": "code_interpreter", "arguments": {"code": f"print({e})"}})[:-1] + f', "id": "call{i:05d}"}}'
             for i, e in enumerate(exprs)]
    return "[TOOL_CALLS] [" + ", ".join(items) + "]"


FAMILY_CALLS = {
    "kimi_k2_thinking": ("kimi_k2", lambda *exprs: "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.code_interpreter:{i}<|tool_call_argument_begin|>{_args(e)}<|tool_call_end|>"
        for i, e in enumerate(exprs)) + "<|tool_calls_section_end|>"),
    "mistral_small_3_1": ("mistral", _mistral_calls),
    "glm_4_5": ("glm45", lambda *exprs: "".join(
        f"\n<tool_call>code_interpreter<arg_key>code</arg_key>\n<arg_value>print({e})</arg_value></tool_call>" for e in exprs) + "<|observation|>"),
    # harmony, as gpt-oss's template writes a call (the recipient in the role's header); one per turn
    "gpt_oss_20b": ("gpt_oss", lambda expr: f" to=functions.code_interpreter<|channel|>commentary json<|message|>{_args(expr)}<|call|>"),
    "deepseek_v3_1": ("deepseek", lambda *exprs: "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>code_interpreter<｜tool▁sep｜>{_args(e)}<｜tool▁call▁end｜>" for e in exprs) + "<｜tool▁calls▁end｜>"),
    "qwen3_coder_vllm": ("qwen3_coder", lambda *exprs: "\n".join(
        f"<tool_call>\n<function=code_interpreter>\n<parameter=code>\nprint({e})\n</parameter>\n</function>\n</tool_call>" for e in exprs)),
    "llama3_1_json": ("llama3_json", lambda *exprs: "<|python_tag|>" + "; ".join(
        f'{{"name": "code_interpreter", "parameters": {_args(e)}}}' for e in exprs)),
}


def _family_scenarios(fmt: str, calls) -> dict[str, Scenario]:
    """The tool-message scenarios above, with the family's own calls (Kimi-K2-Thinking opens every
    turn with its reasoning block, empty or not; Mistral's template writes no text before calls)."""
    def final(text: str) -> str:  # harmony's answers are on its final channel; GLM's end with <|user|>
        return {"gpt_oss": f"<|channel|>final<|message|>{text}", "glm45": f"\n{text}<|user|>"}.get(fmt, text)

    if fmt == "kimi_k2":
        def think(text: str) -> str:
            return f"<think>{text}</think>"
        prior = Message("assistant", "It is 2.", reasoning_content="Easy.")
    elif fmt == "glm45":
        def think(text: str) -> str:
            return f"\n<think>{text}</think>"
        prior = Message("assistant", "It is 2.", reasoning_content="Easy.")
    elif fmt == "gpt_oss":
        def think(text: str) -> str:
            return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant" if text else ""
        prior = Message("assistant", "It is 2.", reasoning_content="Easy.")
    else:
        def think(text: str) -> str:
            return f"<think>\n{text}\n</think>\n\n" if text else ""
        prior = Message("assistant", "<think>\nEasy.\n</think>\n\nIt is 2.")
    lead = {"mistral": "", "glm45": "\nTwo calls."}.get(fmt, "Two calls.\n")
    return {
        "one_call": Scenario((SYSTEM, USER), (think("") + calls("2 + 3"), think("") + final("It is \\boxed{5}.")), format=fmt),
        "parallel_calls": Scenario((SYSTEM, USER), (think("") + lead + (calls("2 + 3", "3 + 2") if fmt != "gpt_oss" else ""),
                                                    think("") + final("Both say \\boxed{5}.")), format=fmt),
        "thinking": Scenario((SYSTEM, USER), (think("I should run it.") + calls("2 + 3"), think("It printed 5.") + final("It is \\boxed{5}.")),
                             format=fmt),
        "several_users": Scenario((SYSTEM, Message("user", "What is 1 + 1?"), prior, USER),
                                  (think("") + calls("2 + 3"), think("The tool said 5.") + final("It is \\boxed{5}.")), format=fmt),
    }


FAMILY_SCENARIOS = {template: _family_scenarios(fmt, calls) for template, (fmt, calls) in FAMILY_CALLS.items()}


def scenario_of(template: str, name: str) -> Scenario:
    return FAMILY_SCENARIOS[template][name] if template in FAMILY_SCENARIOS else SCENARIOS[name]


# Hermes-3's tool_use template needs tools (its `default` template is for chat without them): the
# retool scenarios, which pass none, do not apply; enable_thinking is Qwen3's. Llama 3.1's template
# takes one call per turn and has no reasoning, nor has Mistral-Small-3.1's; DeepSeek-V3.1's opens
# <think> in its generation prompt only with thinking=True and only after a user message (none after
# tool output), and renders a reasoning turn from the text after it: the model calls tools in its
# non-thinking mode (not run here). Kimi-K2-Thinking, Mistral and gpt-oss take a turn in parts: the
# loop records it so (raytool.agent.turns); gpt-oss's template writes one call per turn. GLM-4.5's
# turns end with the next role's token (<|observation|>, <|user|>), which the model generates.
CASES = [(t, s) for t in TEMPLATES if t not in FAMILY_SCENARIOS for s in SCENARIOS
         if (s != "no_thinking_mode" or t == "qwen3") and not (t == "hermes3_tool_use" and s.startswith("retool"))]
CASES += [(t, s) for t in FAMILY_SCENARIOS for s in FAMILY_SCENARIOS[t]
          if not (t == "llama3_1_json" and s in ("parallel_calls", "thinking"))
          and not (t in ("deepseek_v3_1", "mistral_small_3_1") and s == "thinking") and not (t == "gpt_oss_20b" and s == "parallel_calls")]
# an answer's reasoning is dropped once a later user turn comes
STRIPS_EARLIER_REASONING = {"qwen3", "deepseek_v3_1", "kimi_k2_thinking", "gpt_oss_20b", "glm_4_5"}


class Script:
    """A scripted engine (replays the scenario's turns: each its tokens, then eos, unless it ends with
    the in-turn stop string) and a scripted sandbox (prints the value of print(<expr>))."""

    def __init__(self, renderer: ChatRenderer, turns):
        self.renderer, self.turns = renderer, list(turns)
        self.prompts: list[list[int]] = []
        self.generated: list[list[int]] = []

    async def generate(self, prompt_ids, sampling, request_id, session):
        text = self.turns[len(self.prompts)]
        self.prompts.append(list(prompt_ids))
        in_turn_stop = any(text.endswith(s) for s in sampling.stop) or closes_itself(self.renderer.fmt, text)  # <|call|>
        ids = self.renderer.encode(text) if in_turn_stop else self.renderer.assistant_ids(text)
        self.generated.append(ids)
        return TokenOutput(ids, [-0.5] * len(ids), "stop", policy_version=1)

    @staticmethod
    async def execute(code_text, session):
        expr = re.fullmatch(r"print\((.*)\)", code_text.strip()).group(1)
        return ExecResult(status="ok", stdout=f"{eval(expr)}\n", exit_code=0)  # noqa: S307 (the scenarios' own arithmetic)


def run(tok, scenario: Scenario):
    tool = CodeInterpreterTool(Script.execute, tokenizer=tok)
    renderer = ChatRenderer(tok, tools=[tool.schema] if scenario.format == "hermes" else None,
                            template_kwargs=dict(scenario.template_kwargs), fmt=scenario.format)
    script = Script(renderer, scenario.turns)
    agent = AgentConfig(format=scenario.format, observation_style=scenario.style, max_turns=6, max_response_tokens=2000)
    loop = ToolAgentLoop(renderer, {"code_interpreter": tool}, script.generate, agent, RolloutConfig(max_tokens_per_turn=500))
    traj = asyncio.run(loop.run(list(scenario.prompt), "5", "t0", "g0"))
    return renderer, script, traj


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("template, scenario", CASES)
def test_rollout_is_token_exact_on_the_real_template(tokenizers, template, scenario):
    tok, sc = tokenizers[template], scenario_of(template, scenario)
    renderer, script, traj = run(tok, sc)
    assert traj.finish_reason == "answer" and len(script.generated) == len(sc.turns)
    rewrite = REWRITES.get(template, lambda text, finished: text)

    # The mask is 1 on exactly the generated ids, in order; everything else is an observation.
    ids = traj.prompt_ids + traj.response_ids
    mask = [0] * len(traj.prompt_ids) + traj.response_mask
    assert [t for t, m in zip(ids, mask) if m] == [t for g in script.generated for t in g]
    starts = [len(p) for p in script.prompts]
    for k, gen in enumerate(script.generated):
        assert ids[starts[k]:starts[k] + len(gen)] == gen and all(mask[starts[k]:starts[k] + len(gen)])
        assert script.prompts[k] == ids[:starts[k]]

    # Each engine prompt is the template's fresh rendering of the conversation so far (up to its rewrite).
    messages = traj.messages[len(sc.prompt):]
    # (in_turn: one assistant turn, so there is no "conversation so far" to re-render)
    for k in range(1, len(script.prompts) if sc.style != "in_turn" else 1):
        history = traj.messages[:len(sc.prompt) + _messages_before_turn(messages, k)]
        fresh = renderer.prompt_text(history)
        seen = decode(tok, script.prompts[k])
        assert rewrite(seen, False) == fresh
        # The observation is what the template writes after the turn it answers, whatever it does to the turn.
        observation = decode(tok, ids[starts[k - 1] + len(script.generated[k - 1]):starts[k]])
        ends = (tok.eos_token, *TEMPLATE_TURN_ENDS.get(sc.format, ()), *NEXT_ROLE_ENDS.get(sc.format, ()))
        assert observation and fresh.endswith(observation) and fresh[: -len(observation)].endswith(ends)
        if rewrite(seen, False) == seen and not TEMPLATES[template].splits_after_generation_prompt:
            assert script.prompts[k] == renderer.encode(fresh)  # token for token

    # The finished conversation.
    full = renderer.conversation_text(traj.messages)
    seen = decode(tok, ids)
    assert full.startswith(rewrite(seen, True)) and full[len(rewrite(seen, True)):] in ("", "\n")
    if rewrite(seen, True) == seen and not TEMPLATES[template].splits_after_generation_prompt:
        assert ids == renderer.encode(full)[:len(ids)]


def _messages_before_turn(messages: list[Message], k: int) -> int:
    """How many of the generated/observed messages come before assistant turn k."""
    seen = 0
    for i, m in enumerate(messages):
        if m.role == "assistant":
            if seen == k:
                return i
            seen += 1
    return len(messages)


@pytest.mark.parametrize("template, scenario", CASES)
def test_sft_on_the_conversation_gives_the_rollout_tokens(tokenizers, template, scenario):
    from raytool.agent.render import as_in_turn

    tok, sc = tokenizers[template], scenario_of(template, scenario)
    renderer, _, traj = run(tok, sc)
    messages = as_in_turn(traj.messages) if sc.style == "in_turn" else traj.messages
    examples = renderer.sft_examples(messages)
    last = examples[-1]
    if TEMPLATES[template].splits_after_generation_prompt and scenario == "several_users":
        # The rollout's prompt holds the first answer re-tokenized with the text around it; SFT keeps
        # it as generated: the same text, split differently at the generation prompt.
        assert decode(tok, last.input_ids) == decode(tok, traj.prompt_ids + traj.response_ids)
        assert last.input_ids[-len(traj.response_ids):] == traj.response_ids
    else:
        assert last.input_ids == traj.prompt_ids + traj.response_ids
    assert last.loss_mask[-len(traj.response_ids):] == traj.response_mask
    # Earlier assistant turns in the prompt are learned too where the template keeps them as they were.
    prompt_learned = decode(tok, [t for t, m in zip(last.input_ids[:-len(traj.response_ids)], last.loss_mask) if m])
    if scenario == "several_users" and template in STRIPS_EARLIER_REASONING:
        # Qwen3 (and DeepSeek-V3.1) strip the first answer's reasoning once the second question comes:
        # that answer is learned in an example of its own, with its reasoning, as rollout produced it.
        assert len(examples) == 2 and prompt_learned == ""
        # The first example is the rollout of the first question, token for token.
        answer = turn_text(sc.format, sc.prompt[2]) + (NEXT_ROLE_ENDS[sc.format][1] if sc.format in NEXT_ROLE_ENDS else "")  # GLM: <|user|>
        _, _, first_traj = run(tok, Scenario(sc.prompt[:2], (answer,), format=sc.format))
        assert examples[0].input_ids == first_traj.prompt_ids + first_traj.response_ids
        assert examples[0].loss_mask == [0] * len(first_traj.prompt_ids) + first_traj.response_mask
    elif scenario == "several_users":
        assert len(examples) == 1 and prompt_learned == sc.prompt[2].content + tok.eos_token
    else:
        assert len(examples) == 1 and prompt_learned == ""


# --- the start-up probe ------------------------------------------------------------------------------


@pytest.fixture
def fresh_probes(monkeypatch):
    """Each renderer probes and logs again (the probe runs once per template in a process)."""
    from raytool.agent import render

    monkeypatch.setattr(render, "_REPORTS", {})


def test_probe_is_quiet_on_prefix_stable_templates(tokenizers):
    from raytool.tools.code_interpreter import SCHEMA

    for name in ("qwen3_instruct_2507", "qwen2_5_instruct", "llama3_1_instruct"):
        for tools in (None, [SCHEMA]):
            assert ChatRenderer(tokenizers[name], tools=tools).template_report == [], (name, tools)


def test_a_template_that_ignores_the_tools_is_said_once_with_a_warning(tokenizer, caplog, fresh_probes):
    """SmolLM2's own template writes no tools: their descriptions vanished without a word."""
    import logging

    from raytool.tools.code_interpreter import SCHEMA

    with caplog.at_level(logging.INFO):
        renderer = ChatRenderer(tokenizer, tools=[SCHEMA])
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "does not list the tools in the prompt" in warning.getMessage() and "code_interpreter" in warning.getMessage()
    assert renderer.template_report and ChatRenderer(tokenizer).template_report == []  # no tools: nothing to say


def test_probe_names_qwen3s_rewrites(tokenizers, caplog, fresh_probes):
    with caplog.at_level("INFO", logger="raytool.agent.render"):
        report = ChatRenderer(tokenizers["qwen3"]).template_report
    assert len(report) == 2, report
    assert "the prompt of message 6 re-renders earlier turns once a new user message comes (message 5)" in report[0]
    assert "SFT makes one example per such user turn" in report[0]
    assert report[1].startswith("message 11 (assistant without reasoning) renders as '<think>\\n\\n</think>")
    assert "in the finished conversation" in report[1]
    assert len(caplog.records) == 2 and all(r.levelname == "INFO" and "the chat template of" in r.getMessage()
                                            and "(sha256 " in r.getMessage() for r in caplog.records)

    no_thinking = ChatRenderer(tokenizers["qwen3"], template_kwargs={"enable_thinking": False}).template_report
    assert any("in the prompt of message 4" in f and "generated tokens are kept as generated" in f for f in no_thinking), no_thinking


def test_probe_names_hermes3s_tool_turn_rewrite(tokenizers):
    from raytool.tools.code_interpreter import SCHEMA

    report = ChatRenderer(tokenizers["hermes3_tool_use"], tools=[SCHEMA]).template_report
    assert any(f.startswith("the tool turn from message 7 renders as '\\n<|im_end|>") and "in the prompt of message 11" in f
               for f in report), report
    with pytest.raises(ValueError, match=r"cannot render a user and an assistant message without tools: TypeError"):
        ChatRenderer(tokenizers["hermes3_tool_use"])


# --- what cannot be rendered exactly is never guessed ------------------------------------------------


def test_an_observation_the_template_cannot_place_ends_the_trajectory(tokenizers, caplog, fresh_probes):
    tok = copy.deepcopy(tokenizers["qwen2_5_instruct"])
    # An assistant turn gets a signature after its content once later turns exist: the conversation
    # is not prefix-stable, and the marker's turn does not end right after its content either.
    old = "message.content + '<|im_end|>' + '\\n'"
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(
        old, "message.content + ('' if loop.last or message.role != 'assistant' else ' (signed)') + '<|im_end|>' + '\\n'")
    with caplog.at_level("WARNING", logger="raytool.agent.render"):
        renderer, script, traj = run(tok, SCENARIOS["one_call"])
    probe = [r for r in caplog.records if r.name == "raytool.agent.render"]
    assert [r.levelname for r in probe] == ["WARNING"] and "render_error" in probe[0].getMessage()
    assert traj.finish_reason == "render_error" and "cannot be derived exactly" in traj.turns[0]["render_error"]
    assert traj.response_ids == script.generated[0] and len(script.generated) == 1  # nothing guessed, nothing lost
    with pytest.raises(RenderError):
        renderer.observation_text([Message("tool", "5")], [SYSTEM, USER, Message("assistant", "x")])


def test_tool_rendering_that_depends_on_the_turn_before_it_is_refused(tokenizers):
    tok = copy.deepcopy(tokenizers["qwen2_5_instruct"])
    # A tool turn that quotes the start of the assistant turn it answers: the marker cannot stand in.
    old = "{{- '\\n<tool_response>\\n' }}"
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, "{{- '\\n<tool_response>' + messages[loop.index0 - 1].content[:3] + '\\n' }}")
    renderer = ChatRenderer(tok)
    with pytest.raises(RenderError, match="depending on the assistant turn before them"):
        renderer.observation_text([Message("tool", "5")], [SYSTEM, USER, Message("assistant", "abc")])


def test_a_turn_in_parts_whose_earlier_turns_render_differently_once_tools_answer_is_refused(tokenizers):
    """Only the turn itself may render differently once the tool messages come (Qwen3's empty
    <think> block on the last turn): a change before it is a prompt the model never saw."""
    tok = copy.deepcopy(tokenizers["qwen2_5_instruct"])
    old = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, "{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                                                       "(' (answered)' if messages[-1].role == 'tool' else '') + '<|im_end|>' + '\\n' }}")
    renderer = ChatRenderer(tok)
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(2 + 3)"}}}
    with pytest.raises(RenderError, match="differently once they come"):
        renderer.observation_text([Message("tool", "5")], [SYSTEM, USER, Message("assistant", "", tool_calls=[call])])
    assert ChatRenderer(tokenizers["qwen2_5_instruct"]).observation_text(  # the template as shipped: the observation
        [Message("tool", "5")], [SYSTEM, USER, Message("assistant", "", tool_calls=[call])]).startswith("\n<|im_start|>user\n<tool_response>")


@pytest.mark.parametrize("template", ["qwen3", "qwen3_instruct_2507", "qwen2_5_instruct", "glm_4_5", "qwen3_coder_vllm", "deepseek_v3_1", "kimi_k2_thinking", "mistral_small_3_1", "gpt_oss_20b"])
def test_a_trace_given_in_parts_trains_the_tokens_a_rollout_of_the_same_turns_gives(tokenizers, template):
    """SFT data in OpenAI's form (calls as tool_calls with ids, reasoning as reasoning_content, tool
    results with their tool_call_id) for each family: written as its models generate the turns, it
    gives the tokens the loop records when the model generates them."""
    tok, sc = tokenizers[template], scenario_of(template, "thinking" if template in ("glm_4_5", "kimi_k2_thinking", "gpt_oss_20b") else "one_call")
    renderer, _, traj = run(tok, sc)
    call = {"id": "functions.code_interpreter:0" if sc.format != "mistral" else "call00000", "type": "function",
            "function": {"name": "code_interpreter", "arguments": {"code": "print(2 + 3)"}}}
    reasoning = {"glm45": ("I should run it.", "It printed 5."), "kimi_k2": ("I should run it.", "It printed 5."),
                 "gpt_oss": ("I should run it.", "It printed 5.")}.get(sc.format, (None, None))
    parts = [*sc.prompt, Message("assistant", "", tool_calls=[call], reasoning_content=reasoning[0]),
             *[Message("tool", m.content, tool_call_id=call["id"]) for m in traj.messages if m.role == "tool"],
             Message("assistant", "It is \\boxed{5}.", reasoning_content=reasoning[1])]
    (example,) = renderer.sft_examples(parts)
    assert example.input_ids == traj.prompt_ids + traj.response_ids
    assert example.loss_mask == [0] * len(traj.prompt_ids) + traj.response_mask
