"""Multi-turn SFT data: rows loaded and checked, tokenized with loss on assistant tokens only, cut, split."""

import copy
import json
import logging
import sys
from pathlib import Path

import pytest

from raytool.agent.render import ChatRenderer
from raytool.data.conversations import Conversation, DataError, load_conversations, sft_examples, split_validation
from raytool.types import Message, ToolCall

FIXTURE = Path(__file__).parent / "fixtures" / "sft_conversations.jsonl"
CHATML_TOOLS = (Path(__file__).parent / "fixtures" / "chatml_tools_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(*pairs) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


def learned_and_ignored(tokenizer, ex) -> tuple[str, str]:
    learned = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    ignored = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    return learned, ignored


def test_good_rows_load_and_bad_rows_are_reported_with_file_and_line(caplog):
    with caplog.at_level(logging.WARNING, logger="raytool.data.conversations"):
        convs, problems = load_conversations(FIXTURE)
    assert [c.source for c in convs] == [f"{FIXTURE} line {n}" for n in (1, 3, 5, 7)]
    assert [c.extra.get("id") for c in convs] == ["retool-1", "hermes-1", "retool-in-turn-1", "chat-1"]
    assert convs[0].extra == {"id": "retool-1", "answer": "24133"}
    assert convs[1].tools[0]["function"]["name"] == "get_weather" and convs[0].tools is None
    assert len(problems) == 3
    assert problems[0].startswith(f"{FIXTURE} line 2: not valid JSON")
    assert problems[1].startswith(f"{FIXTURE} line 4: no 'messages'")
    assert problems[2].startswith(f"{FIXTURE} line 6: messages[0] has role 'bot'")
    assert [r.getMessage() for r in caplog.records] == [f"skipped {p}" for p in problems]


@pytest.mark.parametrize("row, expected", [
    ([1, 2], "a row must be an object with 'messages', got a list"),
    ({"messages": "not json"}, "'messages' is a string but not valid JSON"),
    ({"messages": {"role": "user"}}, "'messages' must be a list, got an object"),
    (chat(("user", "hi"), ("assistant", 5)), "messages[1] (assistant) content must be a string, got int"),
    (chat(("user", "hi"), ("user", "anyone?")), "no assistant message"),
    (chat(("assistant", "I speak first"), ("user", "ok")), "messages[0] is the first assistant message and nothing comes before it"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": {"name": "f"}}]},
     "messages[1].tool_calls must be a list of calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"arguments": {}}]}]},
     "messages[1].tool_calls[0] must be"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{city: Paris}"}]}]},
     "messages[1].tool_calls[0] ('f'): arguments are not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "[1]"}]}]},
     "arguments must be a JSON object, got a list"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"name": "f"}]}, {"role": "assistant", "content": "ok"}]},
     "messages[0] is a user message with tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>", "tool_calls": [{"name": "f"}]}]},
     "has tool_calls and also <tool_call> text"),
    ({**chat(("user", "hi"), ("assistant", "ok")), "tools": [{"description": "no name"}]}, "tools[0] must be an OpenAI function schema"),
    ({**chat(("user", "hi"), ("assistant", "ok")), "tools": "{"}, "'tools' is a string but not valid JSON"),
])
def test_each_kind_of_bad_row_is_reported(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(("user", "hi"), ("assistant", "hello")), row])
    convs, problems = load_conversations(path)
    assert len(convs) == 1 and len(problems) == 1
    assert problems[0].startswith(f"{path} line 2: ") and expected in problems[0]


def test_many_bad_rows_are_logged_ten_lines_then_a_count(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(("user", "hi"), ("assistant", "hello"))] + ["{oops"] * 15)
    with caplog.at_level(logging.WARNING, logger="raytool.data.conversations"):
        _, problems = load_conversations(path)
    assert len(problems) == 15 and len(caplog.records) == 11
    assert caplog.records[-1].getMessage() == f"skipped 5 more in {path}"


@pytest.mark.parametrize("name, content, expected", [
    ("bad.jsonl", "{oops\n[1]\n", "no usable conversation in 2 rows; first problem: {path} line 1: not valid JSON"),
    ("empty.jsonl", "\n", "no usable conversation in 0 rows; the file has no rows"),
    ("array.json", "[1, 2", "cannot read the file (JSONDecodeError"),
    ("data.csv", "a,b\n", "unknown data file type '.csv'"),
    ("latin1.jsonl", b"\xff\xfe{}", "cannot read the file (UnicodeDecodeError"),
    ("missing.jsonl", None, "no such file"),
])
def test_a_file_without_usable_rows_raises_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as err:
        load_conversations(path)
    assert str(err.value).startswith(f"{path}: ") and expected.format(path=path) in str(err.value)


def test_a_json_array_file_is_read_by_item(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([chat(("user", "a"), ("assistant", "b")), {"nope": 1}], indent=2))
    convs, problems = load_conversations(path)
    assert convs[0].source == f"{path} row 0 (0-based)" and problems == [f"{path} row 1 (0-based): no 'messages' (the row has: nope)"]


def test_structured_tool_calls_are_kept_in_parts_and_written_as_the_formats_model_writes_them():
    from raytool.agent.families import FORMATS, get_parser
    from raytool.agent.turns import turn_text

    convs, _ = load_conversations(FIXTURE)
    call_turn = convs[1].messages[2]
    assert call_turn == Message("assistant", "", tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
    assert convs[1].messages[3] == Message("tool", '{"temp_c": 18, "sky": "overcast"}', tool_call_id="call_1")  # name dropped
    assert turn_text("hermes", call_turn) == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turn_text(None, call_turn) == turn_text("hermes", call_turn)
    for fmt in ["hermes", *FORMATS]:  # what SFT trains is what the format's parser reads
        assert get_parser(fmt)(turn_text(fmt, call_turn)).calls == [ToolCall("get_weather", {"city": "Paris"})], fmt


def test_a_turn_the_format_cannot_write_is_a_row_error_and_the_rest_train(tokenizer, caplog):
    convs, _ = load_conversations(FIXTURE)  # one conversation calls get_weather: retool writes code_interpreter calls only
    with caplog.at_level(logging.WARNING):
        examples, stats = sft_examples(convs, tokenizer, max_length=4096, fmt="retool")
    assert stats["unrenderable"] == 1 and stats["count"] == 3
    assert f"{FIXTURE} line 3: messages[2]: agent.format retool writes calls to code_interpreter (a 'code' string) only, not to " \
           "'get_weather': set agent.format" in caplog.text
    reasoning = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "reasoning_content": "Say ok."}]
    conv = _conversation_of(reasoning)
    assert "\n<think>\nSay ok.\n</think>\n\nok" in tokenizer.decode(sft_examples([conv], tokenizer, 4096, fmt="hermes")[0][0].input_ids)
    with pytest.raises(DataError, match="agent.format llama3_json has no reasoning in a turn"):
        sft_examples([conv], tokenizer, 4096, fmt="llama3_json")


def _conversation_of(messages: list[dict]):
    from raytool.data.conversations import _conversation

    return _conversation({"messages": messages}, "row")


# Qwen2.5's way of writing an assistant turn with tool calls (content, then one "\n<tool_call>\n{json}\n</tool_call>"
# per call), in a minimal template; every newline is an expression because HF templates trim them after tags.
QWEN_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{%- if m.content %}{{ '\\n' + m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tool_calls_are_token_exact_with_a_template_that_renders_tool_calls(tmp_path, tokenizer):
    # The same conversation rendered whole by the template from structured tool_calls gives the
    # tokens the SFT example trains on: turns with and without content before the calls,
    # flat and OpenAI-style calls, arguments as an object or a JSON string.
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN_STYLE
    paris = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    nimes = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nîmes"}}}
    messages = [{"role": "user", "content": "Paris, then Nîmes?"},
                {"role": "assistant", "content": "Two calls.", "tool_calls": [paris, paris]},
                {"role": "tool", "content": "18"}, {"role": "tool", "content": "18"},
                {"role": "assistant", "content": "", "tool_calls": [nimes]}, {"role": "tool", "content": "25"},
                {"role": "assistant", "content": "18 °C and 25 °C."}]
    row = {"messages": copy.deepcopy(messages), "tools": [WEATHER]}
    row["messages"][1]["tool_calls"][1] = {"name": "get_weather", "arguments": {"city": "Paris"}}  # flat form
    row["messages"][4] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nîmes"}'}}]}
    convs, _ = load_conversations(write_jsonl(tmp_path / "d.jsonl", [row]))
    (ex,), _ = sft_examples(convs, tok, max_length=4096)
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert ex.input_ids == expected[: len(ex.input_ids)] and tok.decode(expected[len(ex.input_ids):]) == "\n"
    learned, _ = learned_and_ignored(tok, ex)
    assert learned.count("<tool_call>") == 3


def test_loss_mask_covers_assistant_tokens_only(tokenizer):
    from raytool.agent.turns import turn_text

    convs, _ = load_conversations(FIXTURE)
    examples, stats = sft_examples(convs, tokenizer, max_length=4096)
    assert stats["count"] == 4 and stats["truncated"] == stats["dropped"] == 0
    eos = tokenizer.eos_token
    retool, hermes, in_turn, plain = [learned_and_ignored(tokenizer, ex) for ex in examples]
    for conv, (learned, _) in zip([convs[0], convs[1], convs[3]], [retool, hermes, plain]):
        assert learned == "".join(turn_text(None, m) + eos for m in conv.messages if m.role == "assistant")
    assert "<code>" in retool[0] and "\\boxed{24133}" in retool[0] and "sum = 24133" not in retool[0]
    assert "sum = 24133" in retool[1] and "first 100 primes?" in retool[1]
    assert '"arguments": {"city": "Paris"}' in hermes[0] and "overcast" not in hermes[0] and "overcast" in hermes[1]
    assert "\\boxed{24}" in in_turn[0] and "divisors: 24" not in in_turn[0] and "<interpreter>" in in_turn[1]
    assert stats["loss_tokens"] == sum(sum(ex.loss_mask) for ex in examples)


def test_each_tool_list_gets_its_own_prompt(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML_TOOLS
    dialog = [Message("user", "hi"), Message("assistant", "hello")]
    convs = [Conversation(dialog, [WEATHER]), Conversation(dialog), Conversation(dialog, [WEATHER])]
    examples, _ = sft_examples(convs, tok, max_length=4096)
    prompts = [learned_and_ignored(tok, ex)[1] for ex in examples]
    assert "get_weather" in prompts[0] and "get_weather" not in prompts[1] and prompts[2] == prompts[0]


def test_truncation_and_dropping_are_counted(tokenizer):
    renderer = ChatRenderer(tokenizer)
    short = [Message("user", "hi"), Message("assistant", "hello")]
    long_answer = [Message("user", "hi"), Message("assistant", "word " * 200)]
    long_prompt = [Message("user", "tell me " * 200), Message("assistant", "no")]
    max_length = len(renderer.sft_examples(short)[0].input_ids) + 10
    (full,) = renderer.sft_examples(long_answer)
    examples, stats = sft_examples([Conversation(m) for m in (short, long_answer, long_prompt)], tokenizer, max_length)
    assert (stats["count"], stats["truncated"], stats["dropped"]) == (2, 1, 1)
    assert len(examples[1].input_ids) == max_length and examples[1].loss_mask == full.loss_mask[:max_length]
    assert stats["mean_tokens"] == (len(examples[0].input_ids) + max_length) / 2
    with pytest.raises(DataError, match="1 examples have no assistant token within max_length=10"):
        sft_examples([Conversation(long_prompt)], tokenizer, 10)


def test_a_conversation_the_template_rejects_is_counted_not_fatal(tokenizer, caplog):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages[1:] if m.role == 'system' %}"
                         "{{ raise_exception('system message must come first') }}{% endfor %}" + tok.chat_template)
    convs = [Conversation([Message("user", "hi"), Message("assistant", "hello")]),
             Conversation([Message("user", "hi"), Message("system", "be brief"), Message("assistant", "hello")],
                          source="d.jsonl line 2")]
    with caplog.at_level(logging.WARNING, logger="raytool.data.conversations"):
        examples, stats = sft_examples(convs, tok, max_length=512)
    assert len(examples) == 1 and stats["unrenderable"] == 1
    assert caplog.messages == ["skipped d.jsonl line 2: the chat template cannot render it (TemplateError: system message must come first)"]


def test_parquet_round_trip_with_tools_as_a_json_string(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = [json.loads(FIXTURE.read_text().splitlines()[n - 1]) for n in (1, 3, 5, 7)]
    bad = {"messages": [{"role": "bot", "content": "hi"}], "id": "bad"}
    rows = [{**r, "tools": json.dumps(r["tools"]) if "tools" in r else None} for r in [*good[:2], bad, *good[2:]]]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # messages become structs: absent keys read back as null
    convs, problems = load_conversations(path)
    expected, _ = load_conversations(FIXTURE)
    assert [(c.messages, c.tools) for c in convs] == [(c.messages, c.tools) for c in expected]
    assert [c.source for c in convs] == [f"{path} row {i} (0-based)" for i in (0, 1, 3, 4)]
    assert problems == [f"{path} row 2 (0-based): messages[0] has role 'bot'; expected one of system, user, assistant, tool"]


def test_parquet_without_pyarrow_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "sft.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=f"^{path}: reading parquet needs pyarrow"):
        load_conversations(path)


def test_split_is_deterministic_and_disjoint():
    convs = [Conversation([Message("user", str(i)), Message("assistant", "ok")], source=f"f line {i}") for i in range(20)]
    train, val = split_validation(convs, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert {c.source for c in train} | {c.source for c in val} == {c.source for c in convs}
    assert not {c.source for c in train} & {c.source for c in val}
    assert split_validation(convs, 0.25, seed=3) == (train, val)
    assert split_validation(convs, 0.25, seed=4)[1] != val
    assert [c.source for c in val] == sorted((c.source for c in val), key=lambda s: int(s.split()[-1]))  # input order kept
    assert len(split_validation(convs, 3, seed=0)[1]) == 3 and split_validation(convs, 0, seed=0) == (convs, [])
    assert len(split_validation(convs, 0.01, seed=0)[1]) == 1
    for size in (20, 1.0, -1):
        with pytest.raises(ValueError):
            split_validation(convs, size, seed=0)


def test_the_in_run_warm_up_trains_on_sft_train_files_when_named_and_says_so(tokenizer, caplog):
    """The generated task's traces are the warm-up's data only when sft.train_files names none."""
    import random

    from actors.drivers.pipeline import warmup_examples
    from raytool.config import load_config
    from raytool.data.task import load_task

    files = str(Path(__file__).parent / "fixtures" / "sft_conversations.jsonl")
    cfg = load_config(overrides=["data.train_size=16", "data.val_size=2", "trainer.sft_warmup_steps=2", "sft.batch_size=2",
                                 f"sft.train_files=[{files}]", "agent.format=hermes"])  # its calls to get_weather
    task = load_task(cfg)
    assert task.sft_traces  # the generated task has traces: the named files still win
    with caplog.at_level(logging.INFO):
        examples = warmup_examples(cfg, task, tokenizer, random.Random(0))
    assert f"SFT warm-up: 2 steps on 4 of the 4 conversations of sft.train_files ({files})" in caplog.text
    texts = [tokenizer.decode(ex.input_ids) for ex in examples]
    assert len(texts) == 4 and all("marbles" not in t and "among" not in t for t in texts)  # not tool_arith word problems
    with caplog.at_level(logging.INFO):
        generated = warmup_examples(load_config(overrides=["data.train_size=16", "data.val_size=2", "trainer.sft_warmup_steps=1", "sft.batch_size=2"]),
                                    task, tokenizer, random.Random(0))
    assert generated and "generated with the tool_arith task" in caplog.text


def test_in_turn_traces_write_turns_given_in_parts_as_retool_code_and_name_what_they_cannot(tokenizer, caplog):
    from raytool.agent.render import as_in_turn

    code = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}}
    conv = _conversation_of([{"role": "user", "content": "6 * 7?"}, {"role": "assistant", "content": "Run it.", "tool_calls": [code]},
                             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "\\boxed{42}"}])
    (merged,) = as_in_turn(conv.messages)[1:]
    assert merged == Message("assistant", "Run it.\n<code>\n```python\nprint(6 * 7)\n```\n</code>\n<interpreter>\n42\n</interpreter>\n\\boxed{42}")
    weather = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    other = _conversation_of([{"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "", "tool_calls": [weather]},
                              {"role": "tool", "content": "18"}, {"role": "assistant", "content": "18 C"}])
    other = Conversation(messages=as_in_turn(other.messages), source="weather.jsonl line 1")
    with caplog.at_level(logging.WARNING):
        examples, stats = sft_examples([Conversation(messages=[*conv.messages[:1], merged]), other], tokenizer, 4096, fmt="retool")
    assert stats["count"] == 1 and stats["unrenderable"] == 1 and "weather.jsonl line 1: messages[1]: agent.format retool writes" in caplog.text
