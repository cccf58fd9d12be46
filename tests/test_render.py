"""Token-exactness of the rendered conversation: what the loop builds is what the template renders."""

import copy
from pathlib import Path

import pytest

from raytool.agent.render import ChatRenderer
from raytool.data import make_splits, sft_messages
from raytool.types import Message


def test_observation_delta_matches_the_chat_template(renderer, tokenizer):
    msgs = [Message("system", "s"), Message("user", "What is 2*3?")]
    call = "<code>\n```python\nprint(2*3)\n```\n</code>"
    answer = "The answer is \\boxed{6}."
    ids = renderer.prompt_ids(msgs) + renderer.assistant_ids(call)
    ids += renderer.observation_ids([Message("tool", "6")], [*msgs, Message("assistant", call)]) + renderer.assistant_ids(answer)
    full = [*msgs, Message("assistant", call), Message("tool", "6"), Message("assistant", answer)]
    expected = tokenizer.encode(renderer.conversation_text(full), add_special_tokens=False)
    # The template ends the last assistant turn with eos + "\n"; the loop stops at eos.
    assert ids == expected[: len(ids)]
    assert tokenizer.decode(expected[len(ids):]) == "\n"


def test_sft_example_masks_only_assistant_turns(renderer, tokenizer):
    problem = make_splits(3, 1, seed=0)[0][0]
    msgs = sft_messages(problem)
    (ex,) = renderer.sft_examples(msgs)
    assert len(ex.input_ids) == len(ex.loss_mask)
    learned = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    eos = tokenizer.eos_token
    assert learned == msgs[2].content + eos + msgs[4].content + eos
    ignored = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    assert problem.question in ignored and f"tool\n{problem.answer}" in ignored


CHATML_TOOLS = (Path(__file__).parent / "fixtures" / "chatml_tools_template.jinja").read_text()
SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "Run Python.",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


@pytest.fixture
def chatml_tools(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML_TOOLS
    return ChatRenderer(tok, tools=[SCHEMA])


def test_qwen_style_template_merged_tool_messages_are_token_exact(chatml_tools):
    r = chatml_tools
    assert r.template_report == []
    msgs = [Message("system", "Use tools."), Message("user", "2+3 and 4*5?")]
    call = 'Two calls.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2+3)"}}\n</tool_call>\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(4*5)"}}\n</tool_call>'
    obs = [Message("tool", "5"), Message("tool", "20")]
    answer = "So \\boxed{5} and \\boxed{20}."
    history = [*msgs, Message("assistant", call)]
    ids = r.prompt_ids(msgs) + r.assistant_ids(call) + r.observation_ids(obs, history) + r.assistant_ids(answer)
    full = r.conversation_text([*history, *obs, Message("assistant", answer)])
    assert "code_interpreter" in r.tokenizer.decode(r.prompt_ids(msgs))  # the tools are in the system turn
    assert full.count("<|im_start|>user") == 2  # the two tool outputs share one user turn
    expected = r.encode(full)
    assert ids == expected[: len(ids)] and r.tokenizer.decode(expected[len(ids):]) == "\n"
    # The trap: rendering the tool messages one at a time would open a user turn per output.
    assert r.observation_text(obs, history) == ("\n<|im_start|>user<tool_response>\n5\n</tool_response><tool_response>\n20\n"
                                                "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_templates_that_rewrite_earlier_turns_are_reported_once_at_start_up(tokenizer, caplog):
    tok = copy.deepcopy(tokenizer)
    # Strips reasoning from assistant turns before the last one (the real Qwen3 template's rewrites
    # are in test_chat_templates.py).
    tok.chat_template = CHATML_TOOLS.replace(
        "{{ m.content }}\n{%- if m.tool_calls %}",
        "{{ m.content.split('</think>')[-1] if not loop.last else m.content }}\n{%- if m.tool_calls %}")
    with caplog.at_level("INFO", logger="raytool.agent.render"):
        r = ChatRenderer(tok, tools=[SCHEMA])
        again = ChatRenderer(tok, tools=[SCHEMA])  # the same template, tools and kwargs: probed and logged once
    assert again.template_report == r.template_report
    assert r.template_report and r.template_report[0].startswith("message 2 (assistant with reasoning) renders as")
    assert [rec.getMessage() for rec in caplog.records] == [f"{r.name}: {f}" for f in r.template_report]
    # The observation is still the template's own text after the turn, not an offset stand-in.
    history = [Message("user", "q"), Message("assistant", "<think>hm</think>call")]
    assert r.observation_text([Message("tool", "5")], history) == "\n<|im_start|>user<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_in_turn_sft_traces_mask_the_interpreter_blocks(renderer, tokenizer):
    from raytool.agent.loop import interpreter_block
    from raytool.agent.render import as_in_turn

    problem = make_splits(3, 1, seed=0)[0][0]
    msgs = as_in_turn(sft_messages(problem))
    assert [m.role for m in msgs] == ["system", "user", "assistant"]
    assert interpreter_block(problem.answer) in msgs[-1].content
    (ex,) = renderer.sft_examples(msgs)
    learned = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    masked = tokenizer.decode([t for t, m in zip(ex.input_ids[len(renderer.prompt_ids(msgs[:2])):], ex.loss_mask[len(renderer.prompt_ids(msgs[:2])):]) if not m])
    assert masked == interpreter_block(problem.answer) and "<interpreter>" not in learned and learned.endswith(tokenizer.eos_token)
