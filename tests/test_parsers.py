from raytool.agent.parsers import parse_hermes, parse_retool


def test_retool_code_tags():
    r = parse_retool("Let me compute.\n<code>\n```python\nprint(2 * 3)\n```\n</code>")
    assert [c.arguments["code"] for c in r.calls] == ["print(2 * 3)"] and not r.errors


def test_retool_no_call_is_an_answer():
    assert not parse_retool("The answer is \\boxed{6}.").any


def test_retool_malformed_goes_back_as_error():
    r = parse_retool("<code>\n```python\nprint(1)\n")
    assert not r.calls and "never closed" in r.errors[0]
    assert "empty" in parse_retool("<code>\n```python\n```\n</code>").errors[0]


def test_hermes_json_calls_and_errors():
    r = parse_hermes('<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>')
    assert r.calls[0].name == "code_interpreter" and r.calls[0].arguments == {"code": "print(1)"}
    bad = parse_hermes('<tool_call>{"name": "code_interpreter", "arguments": </tool_call>')
    assert not bad.calls and "invalid JSON" in bad.errors[0]
    assert "arguments must be an object" in parse_hermes('<tool_call>{"name": "x", "arguments": 3}</tool_call>').errors[0]
