"""`raytool preprocess`: each public data set's schema (small fixtures in tests/fixtures/sources,
made by make_fixtures.py there) converted to prompt rows or SFT conversations that raytool reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytool.agent.turns import turn_text
from raytool.data.conversations import load_conversations
from raytool.data.preprocess import PREPROCESSORS, SYSTEM_PROMPT, preprocess
from raytool.data.prompts import load_prompt_rows
from raytool.data.rows import DataError

SOURCES = Path(__file__).parent / "fixtures" / "sources"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("name, source, truths, bad", [
    ("dapo_math_17k", "dapo_math_17k.parquet", ["100", "10", "8"],
     ["row 3 (0-based): no 'reward_model.ground_truth'", "row 4 (0-based): 'prompt' has no user message"]),
    ("aime_2024", "aime_2024.jsonl", ["1", "512", "16"], ["line 4: 'Problem' is empty", "line 5: not valid JSON"]),
    ("aime_2025", "aime_2025.parquet", ["70", "117", "588"], ["row 2 (0-based): 'answer' must be an integer, got 'twelve'"]),
    ("gsm8k", "gsm8k.jsonl", ["48", "1250", "10", "3"], ["line 5: 'answer' has no '#### N' final line"]),
    ("gsm8k", "gsm8k_hf", ["48", "10"], ["row 1 (0-based): 'answer' has no '#### N' final line"]),
])
def test_rl_prompts_are_converted_and_bad_rows_named(tmp_path, suffix, name, source, truths, bad):
    report = preprocess(name, SOURCES / source, tmp_path / f"out{suffix}")
    assert (report.converted, report.skipped, report.rows_read) == (len(truths), len(bad), len(truths) + len(bad))
    assert len(report.problems) == len(bad)
    assert all(p.startswith(f"{SOURCES / source} {b}") for p, b in zip(report.problems, bad))
    rows, problems = load_prompt_rows(report.output)
    assert problems == []
    assert [r.ground_truth for r in rows] == truths
    assert {(r.data_source, r.agent_name) for r in rows} == {(name, "tool_agent")}
    assert all([m.role for m in r.prompt] == ["system", "user"] and r.prompt[0].content == SYSTEM_PROMPT for r in rows)


def test_dapo_problem_is_cut_out_of_its_instruction_and_keeps_its_index(tmp_path):
    report = preprocess("dapo_math_17k", SOURCES / "dapo_math_17k.parquet", tmp_path / "d.parquet")
    rows, _ = load_prompt_rows(report.output)
    assert [r.prompt[-1].content for r in rows] == [
        "What is the sum of the first 10 odd numbers?", "Find $x$ if $2^x = 1024$.", "How many primes are below 20?"]
    assert rows[0].extra_info == {"index": "uuid-0", "original_data_source": "math_dapo"}


def test_gsm8k_keeps_the_reasoning_and_drops_thousands_separators(tmp_path):
    rows, _ = load_prompt_rows(preprocess("gsm8k", SOURCES / "gsm8k.jsonl", tmp_path / "g.jsonl").output)
    assert rows[1].ground_truth == "1250"
    assert rows[1].extra_info["reasoning"] == "The farm has 1000+250 = <<1000+250=1250>>1,250 hens."


def test_system_prompt_and_limit_options(tmp_path):
    report = preprocess("aime_2025", SOURCES / "aime_2025.parquet", tmp_path / "a.jsonl", system_prompt="Use tools.", limit=2)
    rows, _ = load_prompt_rows(report.output)
    assert (report.rows_read, report.converted) == (2, 2)
    assert [m.content for m in rows[0].prompt][0] == "Use tools."
    rows, _ = load_prompt_rows(preprocess("aime_2025", SOURCES / "aime_2025.parquet", tmp_path / "b.jsonl", system_prompt="").output)
    assert [m.role for m in rows[0].prompt] == ["user"]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_gsm8k_sft_turns_annotations_into_code_calls(tmp_path, suffix):
    report = preprocess("gsm8k_sft", SOURCES / "gsm8k.jsonl", tmp_path / f"s{suffix}")
    assert (report.converted, report.skipped) == (3, 2)
    assert "line 4: the annotation '<<5 apples - 2=3>>': '5 apples - 2' is not a Python expression" in report.problems[0]
    convs, problems = load_conversations(report.output)
    assert problems == []
    first = convs[0]
    assert [m.role for m in first.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert turn_text("hermes", first.messages[2]) == ('Ann gives 48/2 =\n<tool_call>\n{"name": "code_interpreter", "arguments": '
                                                    '{"code": "print(48/2)"}}\n</tool_call>')
    assert turn_text("retool", first.messages[2]) == "Ann gives 48/2 =\n<code>\n```python\nprint(48/2)\n```\n</code>"
    assert [m.content for m in first.messages if m.role == "tool"] == ["24.0", "48"]  # what print(48/2) shows, not the annotation
    assert first.messages[-1].content == "48 pens.\n\\boxed{48}"
    assert first.tools[0]["function"]["name"] == "code_interpreter"
    assert first.extra["ground_truth"] == "48"
    assert [m.role for m in convs[2].messages] == ["system", "user", "assistant"]  # no annotation, no tool call


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_retool_sft_hermes_splits_the_trace_into_tool_turns(tmp_path, suffix):
    report = preprocess("retool_sft", SOURCES / "retool_sft.parquet", tmp_path / f"r{suffix}")
    assert (report.converted, report.skipped) == (3, 2)
    where = f"{SOURCES / 'retool_sft.parquet'} row"
    assert report.problems == [
        f"{where} 3 (0-based): unbalanced tags in the assistant trace: 1 <code> and 0 </code>",
        f"{where} 4 (0-based): the trace does not end with text, then <answer>...</answer> after the last interpreter output",
    ]
    convs, _ = load_conversations(report.output)
    two_calls = convs[1].messages
    assert two_calls[1].content == "What is 3 + 4, squared?"
    assert [m.role for m in two_calls] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    # the first block has no ``` fence: its body is the code
    assert '{"code": "x = 3 + 4\\nprint(x)"}' in turn_text("hermes", two_calls[2])
    assert turn_text("hermes", two_calls[4]).startswith("Now square it.\n<tool_call>")
    assert [m.content for m in two_calls if m.role == "tool"] == ["7", "49"]
    assert two_calls[-1].content == "\\boxed{49}"
    assert convs[0].messages[-1].content == "So the value is 1024.\n\n\\boxed{1024}"
    assert [m.role for m in convs[2].messages] == ["system", "user", "assistant"]


def test_retool_sft_retool_format_keeps_code_blocks_as_text(tmp_path):
    report = preprocess("retool_sft", SOURCES / "retool_sft.parquet", tmp_path / "r.jsonl", format="retool")
    convs, _ = load_conversations(report.output)
    assert convs[0].messages[2].content == "Let me compute it.\n\n<code>\n```python\nprint(2**10)\n```\n</code>"
    assert convs[0].messages[3].content == "1024"
    assert convs[0].tools is None
    assert "<tool_call>" not in json.dumps([m.content for c in convs for m in c.messages])


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(DataError, match="unknown preprocessor 'gsm9k'; the known ones are: .*aime_2024.*retool_sft"):
        preprocess("gsm9k", SOURCES / "gsm8k.jsonl", tmp_path / "o.jsonl")
    assert set(PREPROCESSORS) == {"dapo_math_17k", "aime_2024", "aime_2025", "gsm8k", "gsm8k_sft", "retool_sft"}


def test_another_data_sets_columns_are_named(tmp_path):
    with pytest.raises(DataError) as err:
        preprocess("aime_2024", SOURCES / "gsm8k.jsonl", tmp_path / "o.jsonl")
    assert str(err.value) == (f"{SOURCES / 'gsm8k.jsonl'}: not aime_2024 data: expected columns Problem, Answer, "
                              "found answer, question; it looks like gsm8k or gsm8k_sft data (raytool preprocess gsm8k ...)")


def test_no_convertible_row_names_the_file_and_the_first_problem(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(DataError, match=rf"{source}: no convertible gsm8k row in 1 rows; first problem: {source} line 1: 'answer' has no"):
        preprocess("gsm8k", source, tmp_path / "o.jsonl")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("kwargs, expected", [
    ({"format": "retool"}, "option format applies to gsm8k_sft, retool_sft"),
    ({"limit": 0}, "limit must be a positive number of rows"),
    ({"output": "o.csv"}, "write the output as .parquet or .jsonl"),
])
def test_bad_options_are_refused_before_reading(tmp_path, kwargs, expected):
    output = tmp_path / kwargs.pop("output", "o.jsonl")
    with pytest.raises(DataError, match=expected):
        preprocess("gsm8k", SOURCES / "gsm8k.jsonl", output, **kwargs)


def test_summary_lists_the_skipped_rows(tmp_path):
    summary = preprocess("gsm8k_sft", SOURCES / "gsm8k.jsonl", tmp_path / "s.jsonl").summary()
    assert summary.splitlines()[0] == (f"gsm8k_sft: 5 rows read from {SOURCES / 'gsm8k.jsonl'}, 3 converted, "
                                       f"2 skipped -> {tmp_path / 's.jsonl'}")
    assert summary.splitlines()[2] == f"  skipped {SOURCES / 'gsm8k.jsonl'} line 5: 'answer' has no '#### N' final line"
