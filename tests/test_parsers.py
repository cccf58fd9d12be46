"""Tool-call parsing: calls found, unambiguous mistakes repaired, the rest answered with a ToolError."""

import json
import time

import pytest

from raytool.agent.families import get_parser
from raytool.agent.parsers import (
    ParseResult,
    ToolError,
    check_arguments,
    parse_hermes,
    parse_retool,
)
from raytool.tools.base import ERROR_KINDS
from raytool.tools.code_interpreter import SCHEMA as CODE_SCHEMA
from raytool.types import ToolCall


def hermes(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def only_call(result: ParseResult) -> ToolCall:
    assert not result.errors, result.errors
    assert len(result.calls) == 1
    return result.calls[0]


def only_error(result: ParseResult) -> ToolError:
    assert not result.calls and len(result.errors) == 1, result
    error = result.errors[0]
    assert error.kind in ERROR_KINDS and error.message.startswith(f"Error ({error.kind}): ")
    assert len(error.message) <= 200, error.message
    return error


# --- retool ---------------------------------------------------------------------------------------


def test_retool_code_tags():
    r = parse_retool("Let me compute.\n<code>\n```python\nprint(2 * 3)\n```\n</code>")
    assert [c.arguments["code"] for c in r.calls] == ["print(2 * 3)"] and not r.errors
    assert r.calls[0].name == "code_interpreter"


def test_retool_no_call_is_an_answer():
    assert not parse_retool("The answer is \\boxed{6}.").any


@pytest.mark.parametrize(
    "block",
    [
        "<code>\n```py\nx = 1\nprint(x)\n```\n</code>",
        "<code>\n```\nx = 1\nprint(x)\n```\n</code>",
        "<code>\nx = 1\nprint(x)\n</code>",
        "<code>\n    x = 1\n    print(x)\n</code>",  # indented bare code is dedented
        "<code>```python\nx = 1\nprint(x)\n```</code>",
    ],
)
def test_retool_fences_and_bare_code(block):
    assert only_call(parse_retool(block)).arguments == {"code": "x = 1\nprint(x)"}


def test_retool_keeps_indentation_inside_the_code():
    code = "for i in range(2):\n    print(i)"
    assert only_call(parse_retool(f"<code>\n```python\n{code}\n```\n</code>")).arguments["code"] == code


def test_retool_unterminated_and_empty():
    error = only_error(parse_retool("<code>\n```python\nprint(1)\n"))
    assert error.kind == "unterminated_tag" and "never closed" in error.message and "</code>" in error.message
    for empty in ["<code>\n```python\n```\n</code>", "<code>  \n</code>"]:
        error = only_error(parse_retool(empty))
        assert error.kind == "empty_call" and "empty" in error.message


def test_retool_unclosed_block_then_a_good_one_keeps_order():
    r = parse_retool("<code>print(1)\n<code>print(2)</code>")
    assert [type(item).__name__ for item in r.items()] == ["ToolError", "ToolCall"]
    assert r.errors[0].kind == "unterminated_tag" and r.calls[0].arguments == {"code": "print(2)"}


# --- hermes: well-formed ---------------------------------------------------------------------------


def test_hermes_json_call():
    r = parse_hermes(hermes('{"name": "code_interpreter", "arguments": {"code": "print(1)"}}'))
    assert only_call(r) == ToolCall("code_interpreter", {"code": "print(1)"}) and r.repaired == 0


def test_hermes_valid_escapes_are_left_alone():
    # A newline between statements stays a newline; an escaped backslash stays one backslash.
    body = r'{"name": "code_interpreter", "arguments": {"code": "x = 1\nprint(\"a\\nb\", x)\t# \u00e9"}}'
    r = parse_hermes(hermes(body))
    assert only_call(r).arguments["code"] == 'x = 1\nprint("a\\nb", x)\t# \u00e9' and r.repaired == 0


def test_hermes_missing_arguments_is_no_arguments():
    assert only_call(parse_hermes(hermes('{"name": "clock"}'))).arguments == {}


def test_hermes_several_calls_with_a_malformed_one_in_the_middle():
    text = (
        "First:\n" + hermes('{"name": "a", "arguments": {"x": 1}}') + "\nthen\n"
        + hermes('{"name": "b", "arguments": {"x": 2}')  # one brace short
        + "\nand\n" + hermes('{"name": "c", "arguments": {"x": 3}}')
    )
    r = parse_hermes(text)
    assert [c.name for c in r.calls] == ["a", "c"]
    assert [e.kind for e in r.errors] == ["invalid_json"]
    assert [type(item).__name__ for item in r.items()] == ["ToolCall", "ToolError", "ToolCall"]


# --- hermes: repairs -------------------------------------------------------------------------------


def test_hermes_latex_in_code_string_is_kept_as_written():
    # `\n` is the newline the model meant; `\frac` is LaTeX, not a form feed followed by "rac".
    body = (
        r'{"name": "code_interpreter", "arguments": '
        r'{"code": "import sympy as sp\nprint(sp.latex(sp.Rational(1,2)))  # \frac{1}{2}"}}'
    )
    r = parse_hermes(hermes(body))
    assert only_call(r).arguments["code"] == "import sympy as sp\nprint(sp.latex(sp.Rational(1,2)))  # \\frac{1}{2}"
    assert r.repaired == 1


@pytest.mark.parametrize(
    "written, meant",
    [
        (r"\sqrt{x}", "\\sqrt{x}"),  # invalid escape
        (r"re.findall(r'\d+', s)", "re.findall(r'\\d+', s)"),  # regex
        (r"\beta + \rho \right)", "\\beta + \\rho \\right)"),  # \b, \r before a letter: LaTeX
        (r"\underline{x}", "\\underline{x}"),  # \u without four hex digits
        (r"\forall \bar{x}", "\\forall \\bar{x}"),
    ],
)
def test_hermes_invalid_and_latex_escapes_keep_their_backslash(written, meant):
    r = parse_hermes(hermes('{"name": "t", "arguments": {"q": "%s"}}' % written))
    assert only_call(r).arguments["q"] == meant and r.repaired == 1


def test_hermes_control_escapes_before_non_letters_are_kept():
    r = parse_hermes(hermes(r'{"name": "t", "arguments": {"q": "a\r\nb\f1\b "}}'))
    assert only_call(r).arguments["q"] == "a\r\nb\f1\b " and r.repaired == 0


def test_hermes_raw_newlines_and_tabs_in_strings():
    r = parse_hermes(hermes('{"name": "code_interpreter", "arguments": {"code": "for i in range(2):\n\tprint(i)"}}'))
    assert only_call(r).arguments["code"] == "for i in range(2):\n\tprint(i)" and r.repaired == 1


def test_hermes_trailing_comma():
    r = parse_hermes(hermes('{"name": "t", "arguments": {"xs": [1, 2,], "s": "a,}"},\n}'))
    assert only_call(r).arguments == {"xs": [1, 2], "s": "a,}"} and r.repaired == 1


def test_hermes_arguments_as_a_json_string():
    r = parse_hermes(hermes('{"name": "code_interpreter", "arguments": "{\\"code\\": \\"print(1)\\"}"}'))
    assert only_call(r).arguments == {"code": "print(1)"} and r.repaired == 1


def test_hermes_parameters_spelling():
    r = parse_hermes(hermes('{"name": "t", "parameters": {"x": 1}}'))
    assert only_call(r).arguments == {"x": 1} and r.repaired == 1


def test_hermes_fenced_json():
    r = parse_hermes(hermes('\n```json\n{"name": "t", "arguments": {"x": 1}}\n```\n'))
    assert only_call(r).arguments == {"x": 1} and r.repaired == 1


def test_hermes_repaired_counts_calls_not_fixes():
    # One call with three fixes, one clean call: one repaired call.
    text = hermes('```json\n{"name": "t", "arguments": {"q": "\\sqrt{2}\n",},}\n```') + hermes('{"name": "u"}')
    r = parse_hermes(text)
    assert [c.arguments for c in r.calls] == [{"q": "\\sqrt{2}\n"}, {}] and r.repaired == 1


# --- hermes: errors --------------------------------------------------------------------------------


def test_hermes_invalid_json_points_at_what_the_model_wrote():
    error = only_error(parse_hermes(hermes('{"name": "code_interpreter", "arguments": </tool_call>')))
    assert error.kind == "invalid_json" and "not valid JSON" in error.message and '"arguments": {...}' in error.message
    # The position is in the text as written, not as repaired (the raw newline became two chars).
    error = only_error(parse_hermes(hermes('{"name": "t",\n "arguments": {"q": "a\nb" "c"}}')))
    assert "Expecting ',' delimiter at line 3 column 4" in error.message


@pytest.mark.parametrize(
    "body, phrase",
    [
        ('[{"name": "a", "arguments": {}}]', "one JSON object, got array"),
        ('{"arguments": {"x": 1}}', 'no "name"'),
        ('{"name": 3, "arguments": {}}', 'no "name"'),
        ("{'name': 'a', 'arguments': {}}", "not valid JSON"),  # Python quotes: not unambiguous
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_hermes_malformed_call_is_invalid_json(body, phrase):
    error = only_error(parse_hermes(hermes(body)))
    assert error.kind == "invalid_json" and phrase in error.message


@pytest.mark.parametrize("args, got", [("3", "integer"), ("[1]", "array"), ('"not json"', "string"), ("null", "null")])
def test_hermes_arguments_not_an_object(args, got):
    error = only_error(parse_hermes(hermes('{"name": "x", "arguments": %s}' % args)))
    assert error.kind == "wrong_argument_type"
    assert f"must be a JSON object, got {got}" in error.message and "'x'" in error.message


def test_messages_stay_short_whatever_the_model_wrote():
    long = "x" * 500
    only_error(parse_hermes(hermes('{"name": "%s", "arguments": 3}' % long)))  # asserts <= 200 chars
    schema = {"function": {"parameters": {"properties": {long: {"type": "string"}}, "required": [long]}}}
    for arguments in [{}, {long: 1}]:
        assert len(check_arguments(ToolCall(long, arguments), schema).message) <= 200


def test_hermes_unterminated_and_empty():
    error = only_error(parse_hermes('<tool_call>{"name": "t", "arguments": {}}'))
    assert error.kind == "unterminated_tag" and "never closed" in error.message and "</tool_call>" in error.message
    error = only_error(parse_hermes("<tool_call> \n </tool_call>"))
    assert error.kind == "empty_call" and "empty" in error.message
    assert not parse_hermes("No call here, just </tool_call> text.").any


def test_tool_error_kind_is_checked():
    with pytest.raises(ValueError, match="unknown tool error kind 'bad_kind'"):
        ToolError("bad_kind", "x")


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 20_000,
        "<tool_call>" + '{"a": "' + "\\" * 200_000,
        "<tool_call>{" + ", " * 100_000 + "</tool_call>",
        "<tool_call>" + '"' * 200_000 + "</tool_call>",
        "<tool_call>" + ("</tool_call" + "<tool_cal") * 10_000,
        "<code>" * 35_000,
        "<code>```" + "`" * 200_000 + "</code>",
        "<code>\n```python\nx" * 20_000,  # fences never closed
        "<code>\n```\n" * 25_000,  # each fence closed by the next block's
        "<code>```\n" + "\n```" * 50_000 + "</code>" * 10_000,
        "<code>```\n" * 20_000 + "```" * 20_000,  # each block's closing fence lies past the next block
        "<code>\n```" + "`" * 100_000 + " " * 100_000,
    ],
)
def test_pathological_input_is_fast(text):
    assert len(text) >= 200_000
    started = time.perf_counter()
    (parse_retool if text.startswith("<code>") else parse_hermes)(text)
    # Linear work takes milliseconds; a regex that backtracks on this input takes minutes. The bound
    # is loose so that a loaded CI machine cannot fail it.
    assert time.perf_counter() - started < 5


# --- check_arguments ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "scale": {"type": "number"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "when": {"type": ["string", "null"]},
                "detailed": {"type": "boolean"},
            },
            "required": ["city", "days"],
        },
    },
}


def weather(**arguments) -> ToolError | None:
    return check_arguments(ToolCall("weather", arguments), WEATHER)


def test_check_arguments_accepts_a_good_call_and_ignores_extra_arguments():
    assert weather(city="Paris", days=3, scale=2, unit="c", when=None, detailed=True, mood="sunny") is None
    assert check_arguments(ToolCall("code_interpreter", {"code": "print(1)"}), CODE_SCHEMA) is None


def test_check_arguments_missing_required():
    error = weather(city="Paris")
    assert error.kind == "missing_argument" and "required argument 'days'" in error.message
    assert "city (string, required), days (integer, required)" in error.message and len(error.message) <= 200


@pytest.mark.parametrize(
    "arguments, phrase",
    [
        ({"days": "3"}, "argument 'days' of 'weather' must be integer, got string (\"3\")"),
        ({"days": True}, "must be integer, got boolean (true)"),  # a bool is not an integer
        ({"days": 2.5}, "must be integer, got number (2.5)"),
        ({"scale": "big"}, "must be number, got string"),
        ({"detailed": 1}, "must be boolean, got integer"),
        ({"when": 5}, "must be string or null, got integer"),
        ({"unit": "k"}, 'must be one of ["c", "f"], got "k"'),
        ({"unit": 1}, "must be string, got integer"),
    ],
)
def test_check_arguments_wrong_type(arguments, phrase):
    error = weather(**{"city": "Paris", "days": 3, **arguments})
    assert error.kind == "wrong_argument_type" and phrase in error.message, error
    assert len(error.message) <= 200


def test_check_arguments_number_accepts_an_int():
    assert weather(city="Paris", days=3, scale=2) is None


def test_check_arguments_bad_schema_is_a_clear_error():
    with pytest.raises(ValueError, match="OpenAI function format"):
        check_arguments(ToolCall("t", {}), {"name": "t"})
    schema = {"function": {"parameters": {"properties": {"x": {"type": "int"}}}}}
    with pytest.raises(ValueError, match="unknown type"):
        check_arguments(ToolCall("t", {"x": 1}), schema)


# --- registry ----------------------------------------------------------------------------------------


def test_get_parser():
    assert get_parser("hermes") is parse_hermes and get_parser("retool") is parse_retool
    with pytest.raises(ValueError, match="unknown tool parser 'xml'; expected one of"):
        get_parser("xml")


# --- code fences (retool) ---------------------------------------------------------------------------


def test_retool_tags_inside_fenced_strings_are_code():
    text = ('Check the parser.\n<code>\n```python\nprint("</code>")\ns = "<code>not a call</code>"\nprint(s)\n```\n</code>'
            "\nThen <code>\n```python\nprint(2)\n```\n</code>")
    r = parse_retool(text)
    assert [c.arguments["code"] for c in r.calls] == ['print("</code>")\ns = "<code>not a call</code>"\nprint(s)', "print(2)"]
    assert not r.errors and r.cut_in_fence == 0


def test_retool_fences_closed_before_the_close_tag_keep_blocks_apart():
    text = "<code>```python\nprint(1)```</code> and <code>\n```python\nprint(2)\n```\n</code>"
    r = parse_retool(text)
    assert [c.arguments["code"] for c in r.calls] == ["print(1)", "print(2)"] and r.cut_in_fence == 0
    # A fence left open does not reach into the next fenced block for its closing fence.
    text = "<code>\n```python\nprint(1)\n</code> then <code>\n```python\nprint(2)\n```\n</code>"
    r = parse_retool(text)
    assert [c.arguments["code"] for c in r.calls] == ["print(1)", "print(2)"] and r.cut_in_fence == 1


def test_retool_a_fence_left_open_ends_at_the_first_close_tag_and_is_counted():
    # What in_turn generation hands over when the </code> stop string fired inside a string literal,
    # and what a model that forgot the closing fence writes: the code runs as cut, and it is counted.
    r = parse_retool('<code>\n```python\nprint("</code>')
    assert [c.arguments["code"] for c in r.calls] == ['print("'] and r.cut_in_fence == 1
    r = parse_retool("<code>\n```python\nprint(1)\n</code> and <code>print(2)</code>")
    assert [c.arguments["code"] for c in r.calls] == ["print(1)", "print(2)"] and r.cut_in_fence == 1


# --- no model output can crash a parser --------------------------------------------------------------


@pytest.mark.parametrize("body, phrase", [
    ('{"name": "f", "arguments": {"n": ' + "7" * 5000 + "}}", "4300 digits"),
    ('{"name": "f", "arguments": {"s": "\\ud800"}}', "unpaired surrogate"),
    ('{"name": "f", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
])
def test_undecodable_calls_are_typed_errors(body, phrase):
    error = only_error(parse_hermes(hermes(body)))
    assert error.kind == "invalid_json" and phrase in error.message, error.message


_PIECES = ["<tool_call>", "</tool_call>", "<code>", "</code>", "```", "```python\n", "\n", " ", "{", "}", "[", "]", '"',
           "\\", "\\u", "\\ud800", "d800", ":", ",", '"name"', '"arguments"', '"parameters"', '"code"', '"f"', "null",
           "9" * 4400, "1e999", "-", "0.5", "true", "\x00", "\u2028", "\ud800", "é", "print(1)", "\\n", "\\frac"]
_VALID = [
    '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2.5, null, true]}"}</tool_call>',
    "<code>\n```python\nprint('</code>')\n```\n</code>",
]


def _mutated():
    from hypothesis import strategies as st

    edits = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3), st.sampled_from(_PIECES)), max_size=6)

    def apply(base, changes):
        for at, drop, piece in changes:
            at %= len(base) + 1
            base = base[:at] + piece + base[at + drop:]
        return base

    return st.builds(apply, st.sampled_from(_VALID), edits)


def _model_text():
    from hypothesis import strategies as st

    return st.one_of(st.lists(st.sampled_from(_PIECES), max_size=40).map("".join), st.text(max_size=200), _mutated())


def _check_parse(parse, text):
    result = parse(text)
    items = result.items()
    assert len(items) == len(result.calls) + len(result.errors)
    for item in items:
        if isinstance(item, ToolError):
            assert item.kind in ERROR_KINDS and item.message.startswith(f"Error ({item.kind}): ")
        else:
            assert isinstance(item, ToolCall) and isinstance(item.name, str) and isinstance(item.arguments, dict)
            json.dumps(item.arguments, ensure_ascii=False).encode()  # what is run can be sent on as UTF-8
    return result


def test_parsers_never_raise_on_any_model_output():
    from hypothesis import given, settings

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(_model_text())
    def check(text):
        _check_parse(parse_hermes, text)
        _check_parse(parse_retool, text)

    check()
