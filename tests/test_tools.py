"""Tools: the code interpreter's answers and output budget, Python functions as tools, verl tool YAMLs."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from pathlib import Path
from typing import Literal, Optional

import msgspec
import pytest

from raytool.config import ConfigError, SandboxConfig
from raytool.tools import (CodeInterpreterTool, FunctionTool, ToolContext, ToolResult, ToolSet, function_tool, load_tool_config, tool,
                           tool_config_sandbox_overrides)
from raytool.tools.code_interpreter import NO_OUTPUT
from raytool.types import ExecResult, ToolCall

REPO = Path(__file__).resolve().parent.parent
CTX = ToolContext(trajectory_id="traj-7")


def run(coro):
    return asyncio.run(coro)


def fake_executor(result: ExecResult, seen: list | None = None):
    async def execute(code: str, session: str) -> ExecResult:
        if seen is not None:
            seen.append((code, session))
        return result

    return execute


def call_code(t, code="print(1)") -> ToolResult:
    return run(t.execute(ToolCall("code_interpreter", {"code": code}), CTX))


# ------------------------------------------------------------------ code interpreter


def test_ok_shows_stdout_then_stderr_and_runs_in_the_trajectorys_session():
    seen = []
    t = CodeInterpreterTool(fake_executor(ExecResult("ok", stdout="42\n", stderr="RuntimeWarning: overflow\n"), seen))
    r = call_code(t, "x = 41\nprint(x + 1)")
    assert r.ok and r.kind is None
    assert r.text == "42\nRuntimeWarning: overflow"
    assert seen == [("x = 41\nprint(x + 1)", "traj-7")]


def test_ok_without_output_says_to_print():
    r = call_code(CodeInterpreterTool(fake_executor(ExecResult("ok"))))
    assert r.ok and r.text == NO_OUTPUT


@pytest.mark.parametrize(
    ("result", "kind", "phrase"),
    [
        (ExecResult("error", stderr="Traceback (most recent call last):\nZeroDivisionError: division by zero\n", exit_code=1),
         "exit_error", "ZeroDivisionError: division by zero"),
        (ExecResult("timeout", stdout="partial\n", duration_s=5.0), "timeout", "time limit"),
        (ExecResult("oom", stderr="MemoryError\n"), "oom", "out of memory"),
        (ExecResult("killed", stderr="[sandbox] the interpreter was killed by SIGSEGV.\n"), "killed", "state is lost"),
        (ExecResult("infra_error", stderr="pool is full (256 waiting)"), "sandbox_error", "not your code's"),
    ],
)
def test_each_failure_has_its_kind_and_a_short_error_line(result, kind, phrase):
    r = call_code(CodeInterpreterTool(fake_executor(result)))
    assert not r.ok and r.kind == kind
    assert r.text.startswith(f"Error ({kind}): ")
    assert phrase in r.text
    assert r.metrics["status"] == result.status


def test_timeout_shows_partial_output_and_duration():
    r = call_code(CodeInterpreterTool(fake_executor(ExecResult("timeout", stdout="step 1\n", duration_s=5.0))))
    assert r.text.splitlines() == ["Error (timeout): the code ran past its time limit and was stopped after 5.0 s. Make it faster or split the work.", "step 1"]


def test_sandbox_failure_detail_goes_to_metrics_not_to_the_model():
    r = call_code(CodeInterpreterTool(fake_executor(ExecResult("infra_error", stderr="connect to http://10.0.0.3:8080 refused"))))
    assert "10.0.0.3" not in r.text
    assert "10.0.0.3" in r.metrics["detail"]


def test_executor_that_raises_is_a_sandbox_error_not_an_exception():
    async def broken(code, session):
        raise ConnectionError("token=s3cr3t refused")

    r = call_code(CodeInterpreterTool(broken))
    assert not r.ok and r.kind == "sandbox_error"
    assert "try the same call again" in r.text and "s3cr3t" not in r.text


@pytest.mark.parametrize(
    ("arguments", "kind"),
    [({}, "missing_argument"), ({"code": 3}, "wrong_argument_type"), ({"code": None}, "wrong_argument_type"), ({"code": "  \n"}, "empty_call")],
)
def test_bad_code_argument_is_answered_without_running(arguments, kind):
    seen = []
    t = CodeInterpreterTool(fake_executor(ExecResult("ok"), seen))
    r = run(t.execute(ToolCall("code_interpreter", arguments), CTX))
    assert not r.ok and r.kind == kind and r.text.startswith(f"Error ({kind}): ")
    assert seen == []


def _long_output(n_lines: int) -> str:
    return "FIRST LINE\n" + "".join(f"value {i} = {i * i}\n" for i in range(n_lines)) + "LAST LINE"


def test_token_budget_cuts_the_middle_and_keeps_head_and_tail(tokenizer):
    t = CodeInterpreterTool(fake_executor(ExecResult("ok", stdout=_long_output(300))), tokenizer=tokenizer, max_output_tokens=64)
    text = call_code(t).text
    assert text.startswith("FIRST LINE") and text.endswith("LAST LINE")
    dropped = int(re.search(r"\.\.\. (\d+) tokens truncated \.\.\.", text).group(1))
    assert dropped > 1000
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 64


def test_error_budget_keeps_the_traceback_tail(tokenizer):
    stderr = "Traceback (most recent call last):\n" + "".join(f'  File "<cell>", line {i}, in f{i}\n' for i in range(200)) + "RecursionError: maximum recursion depth exceeded"
    t = CodeInterpreterTool(fake_executor(ExecResult("error", stderr=stderr, exit_code=1)), tokenizer=tokenizer, max_output_tokens=80)
    text = call_code(t).text
    assert text.startswith("Error (exit_error): the code raised an error.\nTraceback")
    assert text.endswith("RecursionError: maximum recursion depth exceeded")
    assert re.search(r"\.\.\. \d+ tokens truncated \.\.\.", text)
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 80


def test_short_output_is_left_alone(tokenizer):
    t = CodeInterpreterTool(fake_executor(ExecResult("ok", stdout="7006652\n")), tokenizer=tokenizer, max_output_tokens=64)
    assert call_code(t).text == "7006652"


def test_without_a_tokenizer_the_budget_is_characters():
    t = CodeInterpreterTool(fake_executor(ExecResult("ok", stdout=_long_output(300))), max_output_chars=120)
    text = call_code(t).text
    assert len(text) <= 120
    assert text.startswith("FIRST LINE") and text.endswith("LAST LINE")
    assert re.search(r"\.\.\. \d+ chars truncated \.\.\.", text)


def test_release_closes_the_trajectorys_session_once():
    closed = []

    async def close_session(session):
        closed.append(session)

    t = CodeInterpreterTool(fake_executor(ExecResult("ok")), close_session=close_session)
    call_code(t)
    call_code(t)
    run(t.release(CTX))
    assert closed == ["traj-7"]


def test_release_survives_a_failing_close_and_no_close(caplog):
    closed = []

    async def close_session(session):
        closed.append(session)
        raise ConnectionError("pool gone")

    with caplog.at_level(logging.WARNING):
        assert run(CodeInterpreterTool(fake_executor(ExecResult("ok")), close_session=close_session).release(CTX)) is None
    assert closed == [CTX.trajectory_id] and "pool gone" in caplog.text  # tried once, failure logged, not raised
    assert run(CodeInterpreterTool(fake_executor(ExecResult("ok"))).release(CTX)) is None


def test_default_schema_is_one_required_string_code():
    fn = CodeInterpreterTool(fake_executor(ExecResult("ok"))).schema["function"]
    assert fn["name"] == "code_interpreter"
    assert fn["parameters"] == {"type": "object", "properties": {"code": {"type": "string", "description": "The Python source to run."}}, "required": ["code"]}


# ------------------------------------------------------------------ python functions as tools


def search(query: str, top_k: int = 3, lang: Literal["en", "zh"] = "en", min_score: Optional[float] = None,
           tags: list[str] | None = None, exact: bool = False, filters: dict[str, float] | None = None) -> str:
    """Search the notes.

    Longer text that is not the description.

    Args:
        query: What to look for,
            in plain words.
        top_k (int): How many hits to return.
        lang: The notes' language.
        min_score: Drop hits below this.

    Returns:
        The hits, one per line.
    """
    return f"{query}:{top_k}:{lang}"


def test_schema_from_signature_and_google_docstring():
    assert function_tool(search).schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for, in plain words."},
                    "top_k": {"type": "integer", "description": "How many hits to return.", "default": 3},
                    "lang": {"enum": ["en", "zh"], "type": "string", "description": "The notes' language.", "default": "en"},
                    "min_score": {"type": ["number", "null"], "description": "Drop hits below this.", "default": None},
                    "tags": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
                    "exact": {"type": "boolean", "default": False},
                    "filters": {"type": ["object", "null"], "additionalProperties": {"type": "number"}, "default": None},
                },
                "required": ["query"],
            },
        },
    }


def convert(amount: float, unit: Literal["km", "mi"]) -> float:
    """Convert a distance.

    :param amount: The distance.
    :param str unit: Its unit,
        km or mi.
    :returns: the other unit.
    """
    return amount * (0.621 if unit == "km" else 1.609)


def test_schema_from_sphinx_docstring_and_name_override():
    fn = function_tool(convert, name="distance", description="Convert km and miles.").schema["function"]
    assert fn["name"] == "distance" and fn["description"] == "Convert km and miles."
    assert fn["parameters"]["properties"] == {
        "amount": {"type": "number", "description": "The distance."},
        "unit": {"enum": ["km", "mi"], "type": "string", "description": "Its unit, km or mi."},
    }
    assert fn["parameters"]["required"] == ["amount", "unit"]


def test_sync_function_runs_in_a_thread_with_defaults():
    loop_thread = []

    def where(x: int, y: int = 10) -> str:
        return f"{x + y} {threading.get_ident() != loop_thread[0]}"

    async def go():
        loop_thread.append(threading.get_ident())
        return await function_tool(where).execute(ToolCall("where", {"x": 5}), CTX)

    r = run(go())
    assert r.ok and r.text == "15 True"


def test_async_function_and_context_injection():
    async def whoami(greeting: str, ctx: ToolContext) -> str:
        await asyncio.sleep(0)
        return f"{greeting} {ctx.trajectory_id}"

    t = function_tool(whoami)
    assert list(t.schema["function"]["parameters"]["properties"]) == ["greeting"]
    r = run(t.execute(ToolCall("whoami", {"greeting": "hi"}), CTX))
    assert r.ok and r.text == "hi traj-7"


def test_exception_inside_the_function_is_a_tool_exception():
    def divide(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    r = run(function_tool(divide).execute(ToolCall("divide", {"a": 1, "b": 0}), CTX))
    assert not r.ok and r.kind == "tool_exception"
    assert r.text == "Error (tool_exception): divide raised ZeroDivisionError: division by zero"


@pytest.mark.parametrize(
    ("arguments", "kind", "phrase"),
    [
        ({"top_k": 2}, "missing_argument", "'query'"),
        ({"query": 3}, "wrong_argument_type", "must be string, got number"),
        ({"query": "x", "lang": "fr"}, "wrong_argument_type", 'one of "en", "zh"'),
        ({"query": "x", "colour": "red"}, "wrong_argument_type", "no argument 'colour'"),
        ({"query": "x", "tags": ["a", 1]}, "wrong_argument_type", "'tags'"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, kind, phrase):
    r = run(function_tool(search).execute(ToolCall("search", arguments), CTX))
    assert not r.ok and r.kind == kind and phrase in r.text


def test_whole_floats_are_accepted_as_integers():
    r = run(function_tool(search).execute(ToolCall("search", {"query": "q", "top_k": 2.0}), CTX))
    assert r.ok and r.text == "q:2:en"


def test_decorator_keeps_the_function_callable_and_toolset_refuses_duplicates():
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    assert isinstance(add, FunctionTool) and add(2, 3) == 5
    ts = ToolSet([add])

    @ts.function(name="mul")
    def multiply(a: int, b: int) -> int:
        return a * b

    assert sorted(ts.tools) == ["add", "mul"]
    assert [s["function"]["name"] for s in ts.schemas] == ["add", "mul"]
    with pytest.raises(ValueError, match="already registered"):
        ts.function(add.fn)


class Point:
    pass


def test_unsupported_signatures_fail_at_registration():
    def bad(p: Point) -> str:
        return ""

    def star(*args: int) -> str:
        return ""

    with pytest.raises(TypeError, match="parameter 'p'.*no JSON-schema equivalent"):
        function_tool(bad)
    with pytest.raises(TypeError, match=r"\*args"):
        function_tool(star)
    with pytest.raises(ValueError, match="tool name"):
        function_tool(lambda x: x)


# ------------------------------------------------------------------ verl tool YAML


class EchoTool:
    """A custom tool built by load_tool_config from its importable path."""

    def __init__(self, config: dict, tool_schema: dict):
        self.prefix = config["prefix"]
        self.schema = tool_schema
        self.name = tool_schema["function"]["name"]

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        return ToolResult(self.prefix + call.arguments["text"], ok=True)

    async def release(self, ctx: ToolContext) -> None:
        pass


class VerlStyleTool:
    def __init__(self, config: dict, tool_schema: dict):
        self.tool_schema = tool_schema

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        return "x", 0.0, {}


def _schema(name: str, param: str = "text") -> dict:
    return {"type": "function", "function": {"name": name, "description": "d",
                                              "parameters": {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


def test_example_e2b_ags_yaml():
    seen, closed = [], []

    async def close_session(session):
        closed.append(session)

    ts = load_tool_config(REPO / "examples/tools/retool_e2b_ags.yaml", code_executor=fake_executor(ExecResult("ok", stdout="372\n"), seen),
                          close_session=close_session)
    assert ts.sandbox_overrides == {
        "backend": "e2b",
        "e2b_domain": "ap-shanghai.tencentags.com",
        "e2b_template": "code-interpreter-v1",
        "e2b_sandbox_timeout_s": 300,
        "timeout_s": 30.0,
        "e2b_api_key_env": "E2B_API_KEY",
    }
    msgspec.convert(ts.sandbox_overrides, SandboxConfig)  # every key is a real sandbox setting
    assert list(ts.tools) == ["code_interpreter"]
    assert ts.schemas[0]["function"]["parameters"]["required"] == ["code"]
    tool_ = ts.tools["code_interpreter"]
    assert call_code(tool_, "print(23 * 17 - 19)").text == "372"
    run(ts.release(CTX))
    assert seen == [("print(23 * 17 - 19)", "traj-7")] and closed == ["traj-7"]


def test_example_sandbox_fusion_yaml():
    ts = load_tool_config(REPO / "examples/tools/sandbox_fusion.yaml", code_executor=fake_executor(ExecResult("ok")))
    assert ts.sandbox_overrides == {
        "backend": "sandbox_fusion",
        "fusion_url": "http://127.0.0.1:8080/run_code",
        "timeout_s": 30.0,
        "memory_mb": 1024,
        "max_concurrency": 128,
    }
    assert isinstance(ts.tools["code_interpreter"], CodeInterpreterTool)


def test_sandbox_fusion_tool_gets_verls_defaults_and_its_schema_name():
    raw = {"tools": [{"class_name": "recipe.retool.retool.CustomSandboxFusionTool",
                      "config": {"sandbox_fusion_url": "http://fusion:8080/run_code", "type": "native"},
                      "tool_schema": _schema("execute", "code")}]}
    ts = load_tool_config(raw)
    assert ts.sandbox_overrides == {"backend": "sandbox_fusion", "fusion_url": "http://fusion:8080/run_code",
                                    "timeout_s": 30.0, "memory_mb": 1024, "max_concurrency": 10}
    assert list(ts.tools) == ["execute"]


def test_any_class_with_e2b_keys_is_the_code_tool(monkeypatch):
    monkeypatch.setenv("AGS_DOMAIN", "ap-guangzhou.tencentags.com")
    raw = {"tools": [{"class_name": "recipe.some_fork.AgsCodeTool",
                      "config": {"e2b_domain": "${oc.env:AGS_DOMAIN}", "e2b_api_key": "$AGS_KEY"}}]}
    ts = load_tool_config(raw)
    assert ts.sandbox_overrides == {"backend": "e2b", "e2b_domain": "ap-guangzhou.tencentags.com", "e2b_api_key_env": "AGS_KEY"}
    assert list(ts.tools) == ["code_interpreter"]


@pytest.mark.parametrize("ref", ["${MY_AGS_KEY}", "$MY_AGS_KEY", "${oc.env:MY_AGS_KEY}"])
def test_api_key_as_an_environment_variable_reference(ref):
    ts = load_tool_config({"tools": [{"class_name": "x.E2BTool", "config": {"e2b_api_key": ref, "e2b_template": "t"}}]})
    assert ts.sandbox_overrides["e2b_api_key_env"] == "MY_AGS_KEY"


@pytest.mark.parametrize("value", ["e2b_0123456789abcdef-secret", "${oc.env:E2B_API_KEY,e2b_0123456789abcdef-secret}"])
def test_literal_api_key_is_refused_without_repeating_it(value, caplog):
    raw = {"tools": [{"class_name": "verl.tools.e2b.E2BTool", "config": {"e2b_domain": "d", "e2b_api_key": value, "surprise": 1}}]}
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as err:
        load_tool_config(raw)
    message = str(err.value)
    assert "0123456789abcdef" not in message and "0123456789abcdef" not in caplog.text
    assert "tools[0]" in message and "e2b_api_key_env" in message and "environment variable" in message


def test_custom_importable_class_is_built_from_config_and_schema():
    raw = {"tools": [
        {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "config": {"sandbox_fusion_url": "http://f/run_code"}},
        {"class_name": f"{__name__}:EchoTool", "config": {"prefix": ">> "}, "tool_schema": _schema("echo")},
    ]}
    ts = load_tool_config(raw)
    assert sorted(ts.tools) == ["code_interpreter", "echo"]
    r = run(ts.tools["echo"].execute(ToolCall("echo", {"text": "hi"}), CTX))
    assert r.ok and r.text == ">> hi"


def test_bad_class_name_names_the_file_and_the_index(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        "    config: {sandbox_fusion_url: 'http://f/run_code'}\n"
        "  - class_name: no_such_package.tools.Nope\n"
        "    config: {}\n"
    )
    with pytest.raises(ConfigError, match=re.escape(f"{path}: tools[1] (no_such_package.tools.Nope): cannot import module 'no_such_package.tools'")):
        load_tool_config(path)


def test_class_that_is_not_a_tool_is_refused_clearly():
    with pytest.raises(ConfigError, match=r"tools\[0\].*looks like a verl BaseTool"):
        load_tool_config({"tools": [{"class_name": f"{__name__}.VerlStyleTool", "tool_schema": _schema("v")}]})
    with pytest.raises(ConfigError, match=r"tools\[0\].*has no attribute 'Missing'"):
        load_tool_config({"tools": [{"class_name": f"{__name__}.Missing"}]})


def test_duplicate_names_and_conflicting_sandboxes_are_errors():
    fusion = {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "config": {"sandbox_fusion_url": "http://a/run_code"}}
    with pytest.raises(ConfigError, match=r"tools\[1\].*already registered"):
        load_tool_config({"tools": [fusion, fusion]})
    other = {"class_name": "x.E2BTool", "config": {"e2b_domain": "d"}, "tool_schema": _schema("py", "code")}
    with pytest.raises(ConfigError, match=r"tools\[1\].*'backend'.*conflicts.*tools\[0\]"):
        load_tool_config({"tools": [fusion, other]})


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        ({"sandbox_fusion_url": "http://f", "default_timeout": "soon"}, "'default_timeout' must be a positive number"),
        ({"sandbox_fusion_url": "http://f", "default_language": "cpp"}, "Python only"),
        ({"sandbox_fusion_url": "http://f", "e2b_domain": "d"}, "both sandbox_fusion_url and e2b_"),
        ({"default_timeout": 30}, "needs config key 'sandbox_fusion_url'"),
    ],
)
def test_bad_code_tool_config_is_named(config, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        load_tool_config({"tools": [{"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "config": config}]})


def test_code_tool_schema_must_take_code():
    raw = {"tools": [{"class_name": "x.E2BTool", "config": {"e2b_domain": "d"}, "tool_schema": _schema("py", "source")}]}
    for read in (load_tool_config, tool_config_sandbox_overrides):
        with pytest.raises(ConfigError, match=r"tools\[0\].*string parameter `code`"):
            read(raw)


def test_unknown_keys_are_warned_about_once(caplog):
    raw = {"tools": [{"class_name": "x.WarnOnceTool", "config": {"e2b_domain": "d", "zz_knob": 1}}]}
    with caplog.at_level(logging.WARNING, logger="raytool.tools.registry"):
        load_tool_config(raw)
        load_tool_config(raw)
    assert caplog.text.count("zz_knob") == 1


def test_sandbox_overrides_alone_build_no_tool():
    raw = {"tools": [
        {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "config": {"sandbox_fusion_url": "http://f/run_code", "default_timeout": 10}},
        {"class_name": "only_on_the_workers.tools.Search", "config": {}},  # not importable here, and not imported
    ]}
    assert tool_config_sandbox_overrides(raw) == {"backend": "sandbox_fusion", "fusion_url": "http://f/run_code", "timeout_s": 10.0,
                                                  "memory_mb": 1024, "max_concurrency": 10}


def test_code_tool_without_an_executor_answers_sandbox_error():
    ts = load_tool_config(REPO / "examples/tools/sandbox_fusion.yaml")
    r = call_code(ts.tools["code_interpreter"])
    assert not r.ok and r.kind == "sandbox_error"


def test_a_runs_tool_yaml_configures_its_sandbox_where_the_config_left_defaults():
    from raytool.resolve import with_tool_sandbox_settings
    from raytool.config import load_config

    yaml_path = str(REPO / "examples/tools/retool_e2b_ags.yaml")
    short = "agent.max_trajectory_s=300"  # within the tool file's sandbox lifetime (sandbox_timeout: 300)
    cfg = with_tool_sandbox_settings(load_config(None, [f"agent.tools={yaml_path}", short]))
    assert (cfg.sandbox.backend, cfg.sandbox.e2b_domain, cfg.sandbox.e2b_template) == ("e2b", "ap-shanghai.tencentags.com", "code-interpreter-v1")
    with pytest.raises(ConfigError, match="sandbox.backend"):
        with_tool_sandbox_settings(load_config(None, [f"agent.tools={yaml_path}", short, "sandbox.backend=sandbox_fusion"]))


def test_the_run_configs_sandbox_url_wins_over_the_tool_yamls_and_says_so(caplog):
    """A recipe's tool YAML names a SandboxFusion URL; the cluster's service is set on the command line."""
    import logging

    from raytool.resolve import with_tool_sandbox_settings
    from raytool.config import load_config

    yaml_path = str(REPO / "examples/tools/sandbox_fusion.yaml")
    with caplog.at_level(logging.INFO):
        cfg = with_tool_sandbox_settings(load_config(None, [f"agent.tools={yaml_path}", "sandbox.fusion_url=http://sandbox-node:8080/run_code"]))
    assert (cfg.sandbox.backend, cfg.sandbox.fusion_url, cfg.sandbox.timeout_s) == ("sandbox_fusion", "http://sandbox-node:8080/run_code", 30.0)
    assert "sandbox.fusion_url: 'http://sandbox-node:8080/run_code' from the run config, not 'http://127.0.0.1:8080/run_code'" in caplog.text


def test_a_row_sees_only_its_tools_created_with_its_tools_kwargs_and_its_prompt_lists_only_them(tokenizer):
    from raytool.agent.loop import ToolAgentLoop
    from raytool.agent.render import ChatRenderer
    from raytool.config import AgentConfig, RolloutConfig
    from raytool.tools.registry import RowTool, row_tool_names
    from raytool.types import Message, TokenOutput

    def lookup(key: str, ctx: ToolContext) -> str:
        """Look a key up in the row's table."""
        return str(ctx.extra.get("create_kwargs", {}).get("table", {}).get(key, "missing"))

    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    toolset = ToolSet([function_tool(lookup), function_tool(shout)])
    # verl rows: the row's tool schemas (or names) and extra_info.tools_kwargs
    names = row_tool_names([{"type": "function", "function": {"name": "lookup"}}])
    assert names == ["lookup"] and row_tool_names(["shout"]) == ["shout"] and row_tool_names(None) is None
    tools = toolset.for_row(names, {"lookup": {"create_kwargs": {"table": {"x": 7}}}})
    assert list(tools) == ["lookup"] and isinstance(tools["lookup"], RowTool)
    assert list(toolset.for_row(None)) == ["lookup", "shout"] and not isinstance(toolset.for_row(None)["lookup"], RowTool)
    with pytest.raises(ValueError, match=r"a prompt row: its tools \['nope'\] are not in the run's tool set \['lookup', 'shout'\]"):
        toolset.for_row(["nope"])

    import copy

    qwen = copy.deepcopy(tokenizer)  # Qwen2.5-Instruct's own template, which lists the tools in the system turn
    qwen.chat_template = (Path(__file__).parent / "fixtures" / "templates" / "qwen2_5_instruct.jinja").read_text()
    renderer = ChatRenderer(qwen, tools=[t.schema for t in tools.values()])
    turns = iter(['<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>',
                  '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>', "done"])
    prompts = []

    async def generate(prompt_ids, sampling, request_id, session):
        prompts.append(tokenizer.decode(prompt_ids))
        ids = tokenizer.encode(next(turns), add_special_tokens=False) + [tokenizer.eos_token_id]
        return TokenOutput(ids, [-0.1] * len(ids), "stop")

    loop = ToolAgentLoop(renderer, tools, generate, AgentConfig(format="hermes", max_turns=4), RolloutConfig())
    traj = run(loop.run([Message("user", "look x up")], "", "t", "g"))
    tool_outputs = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_outputs[0] == "7"  # the row's create_kwargs reached the tool
    assert "unknown_tool" in tool_outputs[1] and traj.tool_error_kinds == {"unknown_tool": 1}  # not this row's tool
    assert '"lookup"' in prompts[0] and '"shout"' not in prompts[0]  # only the row's schemas are rendered


def test_a_row_naming_a_tool_the_run_lacks_stops_the_run_before_any_actor_in_one_line(tokenizer):
    from actors.agent_worker import build_toolset
    from actors.drivers.pipeline import check_row_tools
    from raytool.config import load_config
    from raytool.data.prompts import PromptRow
    from raytool.data.task import Task
    from raytool.types import Message

    row = PromptRow(prompt=[Message("user", "hi")], ground_truth="1", data_source="mine", tools=[{"type": "function", "function": {"name": "web_search"}}])
    ok = PromptRow(prompt=[Message("user", "hi")], ground_truth="1", data_source="mine", tools=["code_interpreter"])
    toolset = build_toolset(load_config(None, []).agent, tokenizer, None)
    check_row_tools(toolset, Task(train=[ok], val=[ok]))
    with pytest.raises(ConfigError, match=r"^validation prompt row 1 \(data source mine\): its tools \['web_search'\] are not in the run's tool set "
                                          r"\['code_interpreter'\] \(agent.tools\)$"):
        check_row_tools(toolset, Task(train=[ok], val=[ok, row]))
