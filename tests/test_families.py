"""The model families' tool-call formats (raytool.agent.families): each parser on what its models
write (one call, parallel calls, arguments that need the schema, malformed calls), `auto` on the
shipped chat templates, `raytool parse-tools`, and the property that no input makes a parser raise."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from raytool.agent import families
from raytool.agent.families import FORMATS, describe, detect, get_parser, split_reasoning
from raytool.agent.parsers import ToolError
from raytool.tools.base import ERROR_KINDS
from raytool.types import ToolCall

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
SCHEMAS = {"get_weather": {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "description": "Where."}, "days": {"type": "integer", "description": "How many days."},
        "metric": {"type": "boolean", "description": "Celsius."}, "hours": {"type": "array", "description": "Which hours."},
        "ratio": {"type": "number", "description": "A ratio."}}, "required": ["city"]}}}}
DS_BEGIN, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

# One output per family with two calls (parallel calls), as its models write them.
TWO_CALLS = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]</s>',
    "qwen3_coder": "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
                   "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
             "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
               "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Oslo\", \"days\": 2}<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek": f"<｜tool▁calls▁begin｜>{DS_BEGIN}get_weather{DS_SEP}{{\"city\": \"Paris\"}}{DS_END}"
                f"{DS_BEGIN}get_weather{DS_SEP}{{\"city\": \"Oslo\", \"days\": 2}}{DS_END}<｜tool▁calls▁end｜>",
    "gpt_oss": "<|channel|>analysis<|message|>Two cities: call twice.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>"
               "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\", \"days\": 2}<|call|>",
}
EXPECTED = [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Oslo", "days": 2})]


@pytest.mark.parametrize("fmt", sorted(TWO_CALLS))
def test_each_family_parses_its_own_parallel_calls(fmt):
    result = get_parser(fmt, SCHEMAS)(TWO_CALLS[fmt])
    assert result.calls == EXPECTED and result.errors == [], result.items()


@pytest.mark.parametrize("fmt", sorted(TWO_CALLS))
def test_a_plain_answer_is_no_call_and_a_cut_call_is_a_typed_error(fmt):
    assert not get_parser(fmt)("The answer is \\boxed{42}.").any
    cut = TWO_CALLS[fmt][: TWO_CALLS[fmt].rindex("Oslo")]  # the turn ends inside the second call's arguments
    result = get_parser(fmt, SCHEMAS)(cut)
    first = [] if fmt == "mistral" else EXPECTED[:1]  # Mistral's calls are one JSON array: cut, none of it reads
    assert result.calls == first and len(result.errors) == 1 and result.errors[0].kind in ERROR_KINDS, result.items()


def test_xml_arguments_are_typed_from_the_tool_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[6, 18]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
    (call,) = get_parser("qwen3_coder", SCHEMAS)(text).calls
    assert call.arguments == {"city": "12", "days": 3, "metric": True, "hours": [6, 18], "ratio": 0.5, "note": "line one\nline two"}
    (untyped,) = get_parser("qwen3_coder")(text).calls  # no schema: every value as written
    assert untyped.arguments["days"] == "3" and untyped.arguments["city"] == "12"
    # A value that does not read as its type stays text: check_arguments then tells the model.
    (odd,) = get_parser("glm45", SCHEMAS)("<tool_call>get_weather<arg_key>days</arg_key><arg_value>two</arg_value></tool_call>").calls
    assert odd.arguments == {"days": "two"}
    (inf,) = get_parser("glm45", SCHEMAS)("<tool_call>get_weather<arg_key>ratio</arg_key><arg_value>inf</arg_value></tool_call>").calls
    assert inf.arguments == {"ratio": "inf"}  # no JSON number: left as written


@pytest.mark.parametrize("fmt, text, kind", [
    ("qwen3_coder", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", "malformed_call"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", "unterminated_tag"),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key></tool_call>", "malformed_call"),
    ("glm45", "<tool_call></tool_call>", "empty_call"),
    ("kimi_k2", "<|tool_call_begin|>functions.get_weather:0{\"city\": \"Paris\"}<|tool_call_end|>", "malformed_call"),
    ("kimi_k2", "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": <|tool_call_end|>", "invalid_json"),
    ("deepseek", f"{DS_BEGIN}get_weather{{\"city\": \"Paris\"}}{DS_END}", "malformed_call"),
    ("deepseek", f"{DS_BEGIN}get_weather{DS_SEP}[1, 2]{DS_END}", "wrong_argument_type"),
    ("gpt_oss", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Par", "unterminated_tag"),
    ("mistral", "[TOOL_CALLS]", "empty_call"),
    ("mistral", "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}", "malformed_call"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', "invalid_json"),
    ("llama3_json", '{"parameters": {"city": "Paris"}}', "invalid_json"),
])
def test_malformed_calls_are_typed_errors_for_the_model(fmt, text, kind):
    result = get_parser(fmt, SCHEMAS)(text)
    assert [e.kind for e in result.errors] == [kind] and result.calls == [], result.items()
    assert result.errors[0].message.startswith(f"Error ({kind}): ") and len(result.errors[0].message) < 300


def test_older_spellings_of_a_family():
    v3 = f"{DS_BEGIN}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{DS_END}"  # DeepSeek-V3 / R1
    assert get_parser("deepseek")(v3).calls == [EXPECTED[0]] and get_parser("deepseek")(v3).repaired == 0  # the fence is V3's format
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo", "days": 2}</s>'
    assert get_parser("mistral")(v11).calls == EXPECTED  # Mistral's v11+ tokenizers
    assert get_parser("llama3_json")('{"name": "get_weather", "arguments": {"city": "Paris"}}').calls == [EXPECTED[0]]
    # decoded with its special tokens, a Llama call turn ends on <|eom_id|> (or <|eot_id|>)
    ended = get_parser("llama3_json")('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>')
    assert ended.calls == [EXPECTED[0]] and ended.errors == []
    # JSON repaired as Hermes calls are: a trailing comma, a LaTeX backslash
    repaired = get_parser("kimi_k2")('<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": "\\frac{1}{2}",}<|tool_call_end|>')
    assert repaired.calls == [ToolCall("f", {"x": "\\frac{1}{2}"})] and repaired.repaired == 1


def test_reasoning_is_told_from_the_rest():
    assert split_reasoning("<think>\nAdd them.\n</think>\n\nIt is 5.") == ("Add them.", "It is 5.")
    assert split_reasoning("Add them.\n</think>\nIt is 5.") == ("Add them.", "It is 5.")  # <think> opened by the template
    harmony = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>5<|return|>"
    assert split_reasoning(harmony) == ("Easy.", "5") and get_parser("gpt_oss")(harmony).calls == []
    assert describe(TWO_CALLS["gpt_oss"], "gpt_oss")["reasoning"] == "Two cities: call twice."
    # <|call|> is an end-of-turn token: an engine may leave it out of the text; the call still reads
    ended_by_engine = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"
    assert get_parser("gpt_oss")(ended_by_engine).calls == [EXPECTED[0]]


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def test_auto_picks_the_format_each_shipped_template_writes():
    for name in ("qwen2_5_instruct.jinja", "qwen3.jinja", "qwen3_instruct_2507.jinja", "hermes3_tool_use.jinja"):
        assert detect(_template(name)) == "hermes", name
    assert detect(_template("llama3_1_instruct.jinja")) == "llama3_json"
    assert detect("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}") is None  # SmolLM2: no tools
    # The other families' templates are not shipped (their tokenizers are large): their markers.
    for fmt, snippet in [("qwen3_coder", "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"), ("glm45", "<arg_key>{{ k }}</arg_key>"),
                         ("kimi_k2", "<|tool_calls_section_begin|>"), ("deepseek", DS_BEGIN), ("gpt_oss", "<|channel|>commentary"),
                         ("mistral", "[TOOL_CALLS]")]:
        assert detect("{% if tools %}" + snippet + "{% endif %}") == fmt


def test_parse_tools_prints_a_table_or_json(tmp_path, capsys):
    from raytool.cli import main

    out = tmp_path / "turn.txt"
    out.write_text(TWO_CALLS["glm45"])
    assert main(["parse-tools", "--format", "glm45", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "format: glm45   calls: 2   errors: 0   repaired: 0"
    assert table[1] == '  1  call   get_weather  {"city": "Paris"}' and table[2] == '  2  call   get_weather  {"city": "Oslo", "days": "2"}'
    out.write_text("<tool_call>get_weather</tool_call><tool_call>")
    assert main(["parse-tools", "--format", "glm45", "--json", str(out)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["calls"], found["errors"]) == (1, 1) and found["items"][1]["error"]["kind"] == "unterminated_tag"
    assert main(["parse-tools", "--format", "xml", str(out)]) == 2
    assert "unknown tool parser 'xml'; expected one of" in capsys.readouterr().err
    assert main(["parse-tools", "--format", "auto", "--model", "tiny-random", str(out)]) == 2
    assert "config key 'agent.format': auto found no tool-call format in the chat template of tiny-random" in capsys.readouterr().err


def _pieces() -> list[str]:
    markers = sorted({m for f in FORMATS.values() for m in f.markers} | {
        "<tool_call>", "</tool_call>", "</function>", "</parameter>", "</arg_key>", "<arg_value>", "</arg_value>", "<|tool_call_end|>",
        "<|tool_call_argument_begin|>", DS_SEP, DS_END, "<|message|>", "<|call|>", "<|end|>", "<|start|>", "[ARGS]", "[CALL_ID]",
        "functions.f:0", "functions.f", "to=functions.f", "f", ">", ";", "<think>", "</think>", "<|tool_calls_section_end|>"})
    return markers + ["{", "}", "[", "]", '"', ":", ",", '"name"', '"parameters"', '"arguments"', "\n", " ", "\\", "9" * 4400, "\ud800", "é"]


def test_no_model_output_makes_a_family_parser_raise():
    """The parsers as written, without the guard that would turn a bug into an error for the model."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from raytool.agent.turns import STRUCTURED, structured_turn, turn_text

    raw = {name: getattr(families, f"_parse_{name}") for name in FORMATS}
    text = st.one_of(st.lists(st.sampled_from(_pieces()), max_size=40).map("".join), st.text(max_size=200),
                     st.builds(lambda base, cut: base[:cut], st.sampled_from(list(TWO_CALLS.values())), st.integers(0, 400)))

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(text)
    def check(text):
        for name, parse in raw.items():
            for schemas in (None, SCHEMAS):
                result = parse(text, schemas)
                for item in result.items():
                    if isinstance(item, ToolError):
                        assert item.kind in ERROR_KINDS and item.message.startswith(f"Error ({item.kind}): "), name
                    else:
                        assert isinstance(item.name, str) and isinstance(item.arguments, dict), name
                        json.dumps(item.arguments, ensure_ascii=False).encode()
        for fmt in STRUCTURED:  # reading a turn back into parts: the parts, or None; written again, the same text
            message = structured_turn(fmt, text, "seed")
            if message is not None and fmt == "kimi_k2":
                assert turn_text(fmt, message) == (text if text.startswith("<think>") else "<think></think>" + text)

    check()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_pathological_outputs_parse_in_linear_time(fmt):
    for text in [marker * 30_000 for marker in FORMATS[fmt].markers] + [TWO_CALLS[fmt] * 2_000, "{" * 100_000, "<|message|>" * 30_000,
                                                                        "{}" + "<|eom_id|> " * 50_000]:
        started = time.perf_counter()
        get_parser(fmt, SCHEMAS)(text)
        assert time.perf_counter() - started < 5, (fmt, text[:40])  # linear work: milliseconds; a quadratic scan: minutes


def test_verls_gpt_oss_case_gives_the_same_call():
    """verl's GptOssToolParser test case (tests/experimental/agent_loop/test_gpt_oss_tool_parser.py):
    a call, then the tool's own message addressed to the assistant, which is no call."""
    text = ("\n<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>"
            '{"location": "Tokyo"}<|call|>\n<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>'
            '{ "temperature": 20, "sunny": true }<|end|>')
    result = get_parser("gpt_oss")(text)
    assert result.calls == [ToolCall("get_current_weather", {"location": "Tokyo"})] and result.errors == []


def _render(template: str, messages: list[dict], tools: list[dict], add_generation_prompt: bool = False) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(jinja2.TemplateError(message))
    env.globals["strftime_now"] = time.strftime  # as transformers gives templates (Mistral's dates its system prompt)
    return env.from_string(template).render(messages=messages, tools=tools, bos_token="<s>", eos_token="</s>",
                                            add_generation_prompt=add_generation_prompt)


# The families' own templates beside the ones test_chat_templates.py runs the loop on, each with its
# source and sha256 (docs/agents.md lists them): where a copy was adapted by the project it comes
# from, that is said.
FAMILY_TEMPLATES = {
    # vLLM examples/tool_chat_template_qwen3coder.jinja: Qwen3-Coder's template as vLLM ships it.
    "qwen3_coder_vllm.jinja": "5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06",
    # meta-llama/Llama-3.1-8B-Instruct's own (test_chat_templates.py checks its sha256).
    "llama3_1_instruct.jinja": None,
    # deepseek-ai/DeepSeek-V3.1's own: llama.cpp models/templates/deepseek-ai-DeepSeek-V3.1.jinja
    # (0374c5b6e4c19370262d93e2c3f2a98c9af9fe1f), written from the hub's tokenizer_config.json.
    "deepseek_v3_1.jinja": "7fe7159748925dc7d9e2aaeb11e4bd3121c311d8d0e3a0d6377fb8550e64c560",
    # moonshotai/Kimi-K2-Thinking's own: llama.cpp models/templates/moonshotai-Kimi-K2-Thinking.jinja
    # (0c3c896ea80643608b4e961eec7e1efcd844e109). (Kimi-K2-Instruct's first template rendered no tool calls.)
    "kimi_k2_thinking.jinja": "833d0c375531149a922a0f2addf9a66cce8e4503c500fe4ca6a95e9d1ed3c75a",
    # zai-org/GLM-4.5's template as llama.cpp ships it (models/templates/glm_4_5.jinja at
    # 623f3dd04b05999ffcb598a88d4f79fa9c3af849): llama.cpp's adaptation (string arguments as one
    # raw_arguments pair), the call format itself GLM's.
    "glm_4_5_llamacpp.jinja": "0f25e04269293cd5dda8b73283c758817d28afea579ac30a5f95cd56f31a7447",
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503's own: llama.cpp models/templates/
    # mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja (9190da2208fbaa161e10f5f0f9ab437faeacba13).
    "mistral_small_3_1.jinja": "773c8c8c2ffb59c8d1069fe423733d2007a88c52d0a838d89e6aae6693b97427",
    # openai/gpt-oss-20b's own (harmony), as mirrored with the model in EchoCog/gpt-oss-20b
    # (chat_template.jinja at f81fef1ddd90d214968e951a76834f1ded130a18).
    "gpt_oss_20b.jinja": "3aff18eca7ee88d43372b19f7e3784fb15d1acd014f31fa2e71614d9453576fa",
}


def test_the_family_templates_are_the_fetched_bytes():
    import hashlib

    for name, digest in FAMILY_TEMPLATES.items():
        if digest is not None:
            assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("fmt, template, arguments_as", [
    ("qwen3_coder", "qwen3_coder_vllm.jinja", dict),
    ("llama3_json", "llama3_1_instruct.jinja", dict),
    ("deepseek", "deepseek_v3_1.jinja", json.dumps),  # its template concatenates the arguments: a JSON string
    ("kimi_k2", "kimi_k2_thinking.jinja", dict),
    ("glm45", "glm_4_5_llamacpp.jinja", dict),
    ("mistral", "mistral_small_3_1.jinja", dict),
    ("gpt_oss", "gpt_oss_20b.jinja", dict),
])
def test_what_a_familys_own_template_writes_for_a_call_its_parser_reads_back(fmt, template, arguments_as):
    """The real template renders an assistant turn with parallel calls (typed arguments: a string, an
    integer); the family's parser reads the same calls back from what follows the generation prompt,
    and auto picks the format."""
    text = _template(template)
    assert detect(text) == fmt
    calls = [{"type": "function", "id": f"functions.{c.name}:{i}", "function": {"name": c.name, "arguments": arguments_as(c.arguments)}}
             for i, c in enumerate(EXPECTED)]  # Kimi's template writes the id, which its models write as functions.NAME:IDX
    if fmt in ("llama3_json", "gpt_oss"):
        calls = calls[:1]  # Llama 3.1's template refuses a second call in a turn; gpt-oss's writes only the first
    tools = [SCHEMAS["get_weather"]]
    before = _render(text, [{"role": "user", "content": "Weather?"}], tools, add_generation_prompt=True)  # what the engine continues
    after = _render(text, [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": calls}], tools)
    assert after.startswith(before)
    turn = after[len(before):]
    result = get_parser(fmt, SCHEMAS)(turn)
    assert result.calls == EXPECTED[: len(calls)] and result.errors == [], (turn, result.items())


# What each family's template writes after its generation prompt for a turn given in parts, up to
# its end-of-turn token (GLM's turns have none: the next role's token ends them), by the parts it
# takes: with or without content before the calls, with or without reasoning.
TURN_CASES = [
    ("qwen3_coder", "qwen3_coder_vllm.jinja", "<|im_end|>", (True,), (False,)),
    ("glm45", "glm_4_5_llamacpp.jinja", "", (True, False), (True, False)),
    ("kimi_k2", "kimi_k2_thinking.jinja", "<|im_end|>", (True, False), (True, False)),
    ("mistral", "mistral_small_3_1.jinja", "</s>", (False,), (False,)),  # it writes no content before calls, and no reasoning
    ("deepseek", "deepseek_v3_1.jinja", "<｜end▁of▁sentence｜>", (True, False), (False,)),
    ("llama3_json", "llama3_1_instruct.jinja", "<|eot_id|>", (False,), (False,)),
    ("hermes", "qwen2_5_instruct.jinja", "<|im_end|>", (True, False), (False,)),
    ("hermes", "qwen3.jinja", "<|im_end|>", (True, False), (True,)),  # the last turn without reasoning gets an empty block
    # harmony: a turn's content or its reasoning goes on the analysis channel, one call per turn; the
    # template ends a call with <|end|> where the model ends it with <|call|>
    ("gpt_oss", "gpt_oss_20b.jinja", "", (True, False), (False,)),
    ("gpt_oss", "gpt_oss_20b.jinja", "", (False,), (True,)),
]


@pytest.mark.parametrize("fmt, template, end, contents, reasonings", TURN_CASES, ids=[f"{c[0]}-{c[1]}" for c in TURN_CASES])
def test_a_turn_in_parts_is_written_as_its_familys_template_writes_it(fmt, template, end, contents, reasonings):
    from raytool.agent.turns import template_dict, turn_text
    from raytool.types import Message

    text, tools = _template(template), [SCHEMAS["get_weather"]]
    user = [{"role": "user", "content": "Weather?"}]
    before = _render(text, user, tools, add_generation_prompt=True)
    arguments = [{"city": "Paris"}, {"city": "Oslo", "days": 2, "metric": True, "hours": [1, 2]}]
    as_text = fmt in ("kimi_k2", "deepseek")  # their templates write a string as given
    calls = [{"type": "function", "id": f"functions.get_weather:{i}",
              "function": {"name": "get_weather", "arguments": json.dumps(a) if as_text else a}} for i, a in enumerate(arguments)]
    for n in ((1,) if fmt in ("llama3_json", "gpt_oss") else (1, 2)):
        for with_content in contents:
            for with_reasoning in reasonings:
                message = Message("assistant", "I will look." if with_content else "", tool_calls=calls[:n],
                                  reasoning_content="Both cities." if with_reasoning else None)
                after = _render(text, [*user, template_dict(message, fmt)], tools)
                assert after.startswith(before)
                written = turn_text(fmt, message).replace("<|call|>", "<|end|>") if fmt == "gpt_oss" else turn_text(fmt, message)
                assert after[len(before):].startswith(written + end), (n, with_content, with_reasoning)
                assert get_parser(fmt, SCHEMAS)(turn_text(fmt, message)).calls == [ToolCall("get_weather", a) for a in arguments[:n]]


def test_a_generated_turn_is_read_back_into_the_parts_its_template_takes():
    from raytool.agent.turns import call_id, structured_turn, turn_text
    from raytool.types import Message

    kimi = ("<think>Two cities.</think>Looking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city":"Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    message = structured_turn("kimi_k2", kimi)
    assert message == Message("assistant", "Looking.", reasoning_content="Two cities.", tool_calls=[
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}])
    assert turn_text("kimi_k2", message) == kimi  # the arguments as written, not re-serialised
    assert structured_turn("kimi_k2", "<think>Done.</think>It is 5.") == Message("assistant", "It is 5.", reasoning_content="Done.")
    for unread in (kimi + "More.", kimi.replace("functions.get_weather:0", "get_weather"), "<think>cut"):
        assert structured_turn("kimi_k2", unread) is None, unread

    # Mistral: ids as written where they have 9 characters, made up (the same for the same seed) where not.
    mistral = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}, {"name": "get_weather", "arguments": {}}]'
    message = structured_turn("mistral", mistral, "traj-0")
    assert [c["id"] for c in message.tool_calls] == ["abc123XYZ", call_id("traj-0", 1)] and len(call_id("traj-0", 1)) == 9
    assert message.tool_calls[0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert turn_text("mistral", message) == mistral[: -len("}]")] + f', "id": "{call_id("traj-0", 1)}"}}]'  # as its template writes it
    assert structured_turn("mistral", "It is 5.") is None and structured_turn("mistral", "[TOOL_CALLS] [{cut") is None

    # harmony: the analysis channel is the reasoning; a call in either header form, or the final answer
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    for header in ("<|channel|>commentary to=functions.get_weather <|constrain|>json", " to=functions.get_weather<|channel|>commentary json"):
        text = f'<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant{header}<|message|>{{"city": "Paris"}}<|call|>'
        assert structured_turn("gpt_oss", text) == Message("assistant", "", reasoning_content="Look it up.", tool_calls=[call])
    final = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>It is 5."
    assert structured_turn("gpt_oss", final) == Message("assistant", "It is 5.", reasoning_content="Done.")
    assert turn_text("gpt_oss", structured_turn("gpt_oss", final)) == final
    assert structured_turn("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{cut<|call|>") is None


def _schema(name: str, properties: dict) -> dict:
    return {name: {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}}


_CODE = _schema("code_interpreter", {"code": {"type": "string"}})
_TAGGED = '\n<tool_call>\n<function=code_interpreter>\n<parameter=code>{}</parameter>\n</function>\n</tool_call>\n'
# verl's CPU tool-parser cases (tests/experimental/agent_loop/test_tool_parser.py: hermes and
# qwen3_coder; the gpt-oss one is above), input -> what raytool reads. Where verl answers a turn
# with one error for the whole turn ("fails closed"), raytool answers each call on its own: the
# well-formed ones run, each malformed one gets its error.
VERL_CASES = [
    ("hermes", '</think><tool_call>{"name": "code_interpreter", "arguments": {bad}}</tool_call>', _CODE, ["invalid_json"]),
    ("hermes", '<think><tool_call>{"name": "code_interpreter", "arguments": {}}</tool_call></think>done', _CODE, ["malformed_call"]),
    ("hermes", '\n</think>\n<tool_call>{"name":"code_interpreter","arguments":{"code":"print(1)"}}</tool_call>\n<tool_call>{bad}</tool_call>\n',
     _CODE, [ToolCall("code_interpreter", {"code": "print(1)"}), "invalid_json"]),  # verl: one error, nothing run
    ("hermes", '\n<think><tool_call>{"name":"code_interpreter","arguments":{"code":"bad"}}</tool_call></think>\n'
               '<tool_call>{"name":"code_interpreter","arguments":{"code":"print(1)"}}</tool_call>\n',
     _CODE, ["malformed_call", ToolCall("code_interpreter", {"code": "print(1)"})]),  # verl: one error, nothing run
    ("hermes", '\n</think><tool_call>{"name":"delete_rows","arguments":{"sheet_name":"Sheet1","rows":["2:3","7:9"]}}</tool_call>\n',
     _schema("delete_rows", {"sheet_name": {"type": "string"}, "rows": {"type": "array"}}),
     [ToolCall("delete_rows", {"sheet_name": "Sheet1", "rows": ["2:3", "7:9"]})]),
    ("qwen3_coder", '\n<tool_call>\n<function=example>\n<parameter=items>[true, false, null]</parameter>\n</function>\n</tool_call>\n',
     _schema("example", {"items": {"type": "array"}}), [ToolCall("example", {"items": [True, False, None]})]),
    ("qwen3_coder", '\n<tool_call>\n<function=example>\n<parameter=items>__import__("os").getcwd()</parameter>\n</function>\n</tool_call>\n',
     _schema("example", {"items": {"type": "array"}}), [ToolCall("example", {"items": '__import__("os").getcwd()'})]),  # kept, never evaluated
    ("qwen3_coder", _TAGGED.format('\nprint("hello")\n'), _CODE, [ToolCall("code_interpreter", {"code": 'print("hello")'})]),
    ("qwen3_coder", '\n<tool_call>\n<function=find_cells>\n<parameter=sheet_name>Sheet1</parameter>\n<parameter=query>Revenue</parameter>\n'
                    '<parameter=case_sensitive>false</parameter>\n<parameter=max_results>10</parameter>\n<parameter=return>all</parameter>\n'
                    '</function>\n</tool_call>\n',
     _schema("find_cells", {"sheet_name": {"type": "string"}, "query": {"type": "string"}, "case_sensitive": {"type": "boolean"},
                            "max_results": {"type": "integer"}, "return": {"type": "string"}}),
     [ToolCall("find_cells", {"sheet_name": "Sheet1", "query": "Revenue", "case_sensitive": False, "max_results": 10, "return": "all"})]),
    ("qwen3_coder", '\n<tool_call>\n<function=recalculate_and_read>\n<parameter=cell_ranges>["A1", "Sheet1!B2:C3"]</parameter>\n</function>\n</tool_call>\n',
     _schema("recalculate_and_read", {"cell_ranges": {"type": "array"}}), [ToolCall("recalculate_and_read", {"cell_ranges": ["A1", "Sheet1!B2:C3"]})]),
    ("qwen3_coder", '\n<tool_call>\n<function=code_interpreter>\n<parameter=code>\nprint("hello")\n</parameter>\n</function>\n', _CODE, ["unterminated_tag"]),
    ("qwen3_coder", '\n<tool_call>\n<parameter=code>\nprint("hello")\n</parameter>\n</tool_call>\n', _CODE, ["malformed_call"]),
    ("qwen3_coder", '\n<tool_call>\n<function=code_interpreter\n<parameter=code>\nprint("hello")\n</parameter>\n</function>\n</tool_call>\n',
     _CODE, ["malformed_call"]),
    # verl: one error for the turn; raytool reads the second block too, whose </tool_call> closes it unambiguously
    ("qwen3_coder", _TAGGED.format('print("ok")') + '<tool_call>\n<function=code_interpreter>\n<parameter=code>print("bad")</parameter>\n</tool_call>\n',
     _CODE, [ToolCall("code_interpreter", {"code": 'print("ok")'}), ToolCall("code_interpreter", {"code": 'print("bad")'})]),
]


@pytest.mark.parametrize("fmt, text, schemas, expected", VERL_CASES)
def test_verls_parser_cases_give_the_same_calls_or_an_error_per_call(fmt, text, schemas, expected):
    items = get_parser(fmt, schemas)(text).items()
    assert [item.kind if isinstance(item, ToolError) else item for item in items] == expected, items
