"""The tools of a run: Python functions as tools, verl tool YAMLs, and the `ToolSet` that holds them.

`function_tool(fn)` (or `@tool`) makes a tool of a plain function: its schema comes from the
signature (str/int/float/bool/list/dict/Optional/Literal) and the docstring (first paragraph; Google
`Args:` or `:param x:` lines), and an exception inside it is answered as a `tool_exception`.

`load_tool_config(path)` reads verl's tool YAML (`tools: [{class_name, config, tool_schema}]`):

- verl's code tools become raytool's `CodeInterpreterTool` under the YAML's schema (its function
  name is the tool's name), and their config becomes `sandbox_overrides`: `SandboxConfig` keys.
  A tool is a code tool when its class is one of `CODE_TOOL_CLASSES` or, whatever its class (the
  TI-ONE x AGS recipe's, verl's tutorial `sandbox.SandboxTool`, a fork's), its config carries
  `sandbox_fusion_url` or an `e2b_*` key.
- SandboxFusion keys (verl's `SandboxFusionTool`, with its defaults where absent):
  sandbox_fusion_url -> fusion_url, default_timeout (30) -> timeout_s, memory_limit_mb (1024) ->
  memory_mb, rate_limit (10, verl's global limit on concurrent cells) -> max_concurrency (per pool)
  unless enable_global_rate_limit is false.
- E2B keys (the TI-ONE x AGS recipe): e2b_domain, e2b_template, sandbox_timeout ->
  e2b_sandbox_timeout_s, default_timeout -> timeout_s, and the API key only as the NAME of an
  environment variable: `e2b_api_key: ${E2B_API_KEY}` (or `$E2B_API_KEY`, `${oc.env:E2B_API_KEY}`)
  or `e2b_api_key_env: E2B_API_KEY`. A literal key is refused and never copied anywhere.
- default_language must be python; type (native), num_workers and enable_global_rate_limit are
  accepted; other keys are logged once and ignored.
- any other class_name is imported (`pkg.mod.Class` or `pkg.mod:Class`), built as
  `Class(config=config, tool_schema=schema)` and must satisfy raytool's `Tool` protocol.

`tool_config_sandbox_overrides(path)` checks the file and returns only the sandbox settings, without
importing or building any tool (the driver uses it; the agent workers build the tools).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Union

import msgspec
import yaml

from raytool.config import ConfigError, SandboxConfig
from raytool.errors import one_line
from raytool.tools.base import Tool, ToolContext, ToolResult
from raytool.tools.code_interpreter import CodeInterpreterTool, OutputBudget, _check_code_schema, _json_type, code_schema
from raytool.types import ToolCall

log = logging.getLogger(__name__)

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style function names may be


# --------------------------------------------------------------------------- python functions


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array", dict: "object", type(None): "null"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Attributes|See Also|Todo)\s*:\s*$")
_ARGS_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params)\s*:\s*$")
_GOOGLE_ARG = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^\s*:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def _type_schema(tp: Any, where: str) -> dict:
    """The JSON schema of a parameter's type hint."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        schema: dict = {"enum": list(args)}
        kinds = {_JSON_TYPES.get(type(v)) for v in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin is Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        if len(options) == 1:
            schema = _type_schema(options[0], where)
            if nullable and isinstance(schema.get("type"), str):
                schema["type"] = [schema["type"], "null"]
            if nullable and "enum" in schema:
                schema["enum"].append(None)
            return schema
        return {"anyOf": [_type_schema(a, where) for a in args]}
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin in (list, tuple, set, frozenset):
        schema = {"type": "array"}
        item = args[0] if args and args[0] is not Ellipsis else None
        if item is not None and (origin is not tuple or len(args) == 1 or args[1] is Ellipsis):
            schema["items"] = _type_schema(item, where)
        return schema
    if origin is dict:
        schema = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            schema["additionalProperties"] = _type_schema(args[1], where)
        return schema
    raise TypeError(f"{where}: type {tp!r} has no JSON-schema equivalent; use str, int, float, bool, list, dict, Optional[...] or Literal[...]")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a docstring's first paragraph and its Google
    `Args:` section or Sphinx `:param x:` lines."""
    lines = inspect.cleandoc(doc or "").splitlines()
    first = []
    for line in lines:
        if not line.strip() or _SECTION.match(line) or line.lstrip().startswith(":"):
            break
        first.append(line.strip())
    params: dict[str, str] = {}
    current: str | None = None
    section_indent: int | None = None  # inside a Google Args section when not None
    entry_indent: int | None = None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        sphinx = _SPHINX_PARAM.match(line)
        if sphinx:
            current, section_indent = sphinx.group(1), None
            params[current] = sphinx.group(2).strip()
            continue
        args_header = _ARGS_SECTION.match(line)
        if args_header:
            section_indent, entry_indent, current = len(args_header.group(1)), None, None
            continue
        if not line.strip():
            continue
        if section_indent is not None:
            if indent <= section_indent:  # the section ended
                section_indent, current = None, None
            else:
                entry = _GOOGLE_ARG.match(line)
                if entry and (entry_indent is None or indent <= entry_indent):
                    entry_indent = indent
                    current = entry.group(1)
                    params[current] = entry.group(2).strip()
                elif current is not None:
                    params[current] = (params[current] + " " + line.strip()).strip()
                continue
        if current is not None and section_indent is None and not line.lstrip().startswith(":") and indent > 0:
            params[current] = (params[current] + " " + line.strip()).strip()  # a :param continuation
        elif line.lstrip().startswith(":") or _SECTION.match(line):
            current = None
    return " ".join(first), params


def _matches(value: Any, schema: dict) -> bool:
    """Whether `value` (decoded JSON) fits `schema` as `_type_schema` writes them (shallow for objects)."""
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_matches(value, s) for s in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is None:
        return True
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind == "null" and value is None:
            return True
        if kind == "string" and isinstance(value, str):
            return True
        if kind == "boolean" and isinstance(value, bool):
            return True
        if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind == "array" and isinstance(value, list):
            return all(_matches(v, schema.get("items", {})) for v in value)
        if kind == "object" and isinstance(value, dict):
            return True
    return False


def _describe(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    kinds = schema.get("type", "any value")
    return " or ".join(kinds) if isinstance(kinds, list) else kinds


class FunctionTool:
    """A Python function (sync or async) as a `Tool`; build it with `function_tool` or `@tool`.
    Calling the object calls the function, so a decorated function still works as one."""

    def __init__(self, fn: Callable, *, name: str | None = None, description: str | None = None, budget: OutputBudget | None = None):
        if not callable(fn):
            raise TypeError(f"function_tool needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "")
        self.budget = budget
        self._is_async = inspect.iscoroutinefunction(fn)
        where = f"tool '{self.name}'"
        if not _TOOL_NAME.match(self.name):
            raise ValueError(f"{where}: a tool name must be 1-64 letters, digits, '_' or '-'; pass name=...")
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:
            raise TypeError(f"{where}: cannot resolve the type hints of {fn!r}: {one_line(exc)}") from None
        doc_description, doc_params = _parse_docstring(inspect.getdoc(fn))
        self._params: dict[str, dict] = {}  # parameter -> its JSON schema
        self._required: list[str] = []
        self._ctx_param: str | None = None  # a parameter typed ToolContext gets the call's context
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{where}: *{p.name} / **{p.name} cannot be described to a model; give the tool named parameters")
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(f"{where}: parameter '{p.name}' is positional-only; tool arguments arrive by name")
            hint = hints.get(p.name, p.annotation)
            if hint is ToolContext:
                self._ctx_param = p.name
                continue
            schema = _type_schema(hint, f"{where}, parameter '{p.name}'")
            if p.name in doc_params and doc_params[p.name]:
                schema["description"] = doc_params[p.name]
            if p.default is p.empty:
                self._required.append(p.name)
            else:
                try:
                    json.dumps(p.default)
                    schema["default"] = p.default
                except (TypeError, ValueError):
                    pass
            self._params[p.name] = schema
        self.schema = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": description or doc_description or f"Call the Python function {self.name}.",
                "parameters": {"type": "object", "properties": self._params, "required": list(self._required)},
            },
        }

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def _check_arguments(self, args: Any) -> ToolResult | None:
        if not isinstance(args, dict):
            return ToolResult(f"Error (wrong_argument_type): {self.name} takes an object of named arguments, got {_json_type(args)}.",
                              ok=False, kind="wrong_argument_type")
        for key in args:
            if key not in self._params:
                return ToolResult(f"Error (wrong_argument_type): {self.name} has no argument '{key}'; its arguments are: "
                                  f"{', '.join(self._params) or 'none'}.", ok=False, kind="wrong_argument_type")
        for key in self._required:
            if key not in args:
                return ToolResult(f"Error (missing_argument): {self.name} needs the argument '{key}'.", ok=False, kind="missing_argument")
        for key, value in args.items():
            if not _matches(value, self._params[key]):
                return ToolResult(f"Error (wrong_argument_type): argument '{key}' of {self.name} must be {_describe(self._params[key])}, "
                                  f"got {_json_type(value)}.", ok=False, kind="wrong_argument_type")
        return None

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        bad = self._check_arguments(call.arguments)
        if bad is not None:
            return bad
        kwargs = {k: (int(v) if self._params[k].get("type") == "integer" and isinstance(v, float) else v) for k, v in call.arguments.items()}
        if self._ctx_param is not None:
            kwargs[self._ctx_param] = ctx
        try:
            value = await self.fn(**kwargs) if self._is_async else await asyncio.to_thread(self.fn, **kwargs)
        except Exception as exc:  # the tool's own bug or refusal: the model sees it, the metrics count it
            log.debug("tool %s raised", self.name, exc_info=True)
            return ToolResult(f"Error (tool_exception): {self.name} raised {one_line(exc)}", ok=False, kind="tool_exception")
        text = str(value)
        return ToolResult(self.budget.fit(text) if self.budget is not None else text, ok=True)

    async def release(self, ctx: ToolContext) -> None:
        """A function holds nothing per trajectory."""


def function_tool(fn: Callable, *, name: str | None = None, description: str | None = None, budget: OutputBudget | None = None) -> FunctionTool:
    """A plain Python function (sync or async, returning something `str()`-able) as a tool.
    Sync functions run in a thread so they never block the agent loop."""
    if isinstance(fn, FunctionTool):
        fn = fn.fn
    return FunctionTool(fn, name=name, description=description, budget=budget)


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
    """Decorator form of `function_tool`: `@tool` or `@tool(name=..., description=...)`."""
    if fn is None:
        return lambda f: function_tool(f, name=name, description=description)
    return function_tool(fn, name=name, description=description)


# --------------------------------------------------------------------------- the tool set


def _check_tool(obj: Any) -> None:
    """Raise a TypeError naming what `obj` lacks to be a raytool `Tool`."""
    kind = type(obj).__name__
    try:
        execute_params = inspect.signature(obj.execute).parameters
    except (AttributeError, TypeError, ValueError):
        execute_params = {}
    if hasattr(obj, "get_openai_tool_schema") or "instance_id" in execute_params:
        raise TypeError(
            f"{kind} looks like a verl BaseTool (execute(instance_id, parameters) -> (response, reward, metrics)); raytool tools "
            "implement `name`, `schema`, `async execute(call, ctx) -> ToolResult` and `async release(ctx)` "
            "(see raytool/tools/base.py), or wrap a plain function with raytool.tools.function_tool"
        )
    missing = []
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        missing.append("a `name` string")
    schema = getattr(obj, "schema", None)
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
        missing.append('a `schema` dict {"type": "function", "function": {...}}')
    for method in ("execute", "release"):
        if not inspect.iscoroutinefunction(getattr(obj, method, None)):
            missing.append(f"an `async def {method}`")
    if missing:
        raise TypeError(f"{kind} is not a raytool Tool: it lacks {', '.join(missing)} (see raytool/tools/base.py)")
    if obj.schema["function"].get("name") != obj.name:
        raise TypeError(f"{kind}: its name '{obj.name}' differs from its schema's function name '{obj.schema['function'].get('name')}'")
    if not _TOOL_NAME.match(obj.name):
        raise TypeError(f"{kind}: tool name '{obj.name}' must be 1-64 letters, digits, '_' or '-'")


def row_tool_names(tools: list | None) -> list[str] | None:
    """The tool names a prompt row's `tools` column selects: OpenAI schemas (their function names)
    or plain names; None (the column empty): the run's whole tool set."""
    if tools is None:
        return None
    return [t if isinstance(t, str) else (t.get("function") or {}).get("name", "") for t in tools]


class RowTool:
    """A tool as one prompt row creates it: verl's per-row `tools_kwargs[name]` (`create_kwargs`,
    `execute_kwargs`, ...) reach every call of it in `ctx.extra` (a function tool reads them from
    its ToolContext argument)."""

    def __init__(self, tool: Tool, kwargs: dict):
        self.tool, self.kwargs = tool, kwargs
        self.name, self.schema = tool.name, tool.schema

    def __repr__(self) -> str:
        return f"RowTool({self.tool!r}, {sorted(self.kwargs)})"

    def _ctx(self, ctx: ToolContext) -> ToolContext:
        return ToolContext(ctx.trajectory_id, {**ctx.extra, **self.kwargs})

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        return await self.tool.execute(call, self._ctx(ctx))

    async def release(self, ctx: ToolContext) -> None:
        await self.tool.release(self._ctx(ctx))


class ToolSet:
    """The tools one agent loop may call (`tools`, by name), their OpenAI schemas for the chat
    template (`schemas`), and the sandbox settings their config implied (`sandbox_overrides`:
    `SandboxConfig` keys, to apply over the run's `sandbox` section)."""

    def __init__(self, tools: list[Tool] = (), sandbox_overrides: dict | None = None):
        self.tools: dict[str, Tool] = {}
        self.sandbox_overrides: dict = dict(sandbox_overrides or {})
        for t in tools:
            self.register(t)

    def __repr__(self) -> str:
        return f"ToolSet({sorted(self.tools)}, sandbox_overrides={self.sandbox_overrides})"

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def check_names(self, names: list[str] | None, where: str) -> None:
        unknown = sorted(set(names or ()) - set(self.tools))
        if unknown:
            raise ValueError(f"{where}: its tools {unknown} are not in the run's tool set {sorted(self.tools)} (agent.tools)")

    def for_row(self, names: list[str] | None, tools_kwargs: dict | None = None) -> dict[str, Tool]:
        """The tools one row's trajectories see: `names` of them (None: all), each created with the
        row's `tools_kwargs[name]` where it has one."""
        self.check_names(names, "a prompt row")
        chosen = {n: self.tools[n] for n in (self.tools if names is None else names)}
        kwargs = tools_kwargs or {}
        return {n: RowTool(t, kwargs[n]) if isinstance(kwargs.get(n), dict) else t for n, t in chosen.items()}

    def register(self, tool_: Tool) -> Tool:
        _check_tool(tool_)
        existing = self.tools.get(tool_.name)
        if existing is not None:
            raise ValueError(
                f"a tool named '{tool_.name}' is already registered ({type(existing).__name__}); tool names must be unique: "
                "rename one (function_tool's name=, or the function name in the YAML's tool_schema)"
            )
        self.tools[tool_.name] = tool_
        return tool_

    def function(self, fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
        """Register a Python function as a tool; also a decorator (`@toolset.function`)."""
        if fn is None:
            return lambda f: self.function(f, name=name, description=description)
        return self.register(function_tool(fn, name=name, description=description))

    async def release(self, ctx: ToolContext) -> None:
        """Release every tool for a finished trajectory; one tool's failure does not skip the others."""
        for t in self.tools.values():
            try:
                await t.release(ctx)
            except Exception as exc:
                log.warning("tool %s: release for trajectory %s failed: %s", t.name, ctx.trajectory_id, one_line(exc))


# --------------------------------------------------------------------------- verl tool YAML


# verl classes that ARE a code interpreter (verified in volcengine/verl: verl/tools/sandbox_fusion_tools.py,
# recipe/retool/retool.py) -> the backend they imply; raytool's own class implies none.
CODE_TOOL_CLASSES = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "sandbox_fusion",
    "recipe.retool.retool.CustomSandboxFusionTool": "sandbox_fusion",
    "raytool.tools.CodeInterpreterTool": None,
    "raytool.tools.code_interpreter.CodeInterpreterTool": None,
}
_FUSION_KEYS = {"sandbox_fusion_url", "rate_limit", "enable_global_rate_limit", "num_workers"}
_E2B_KEYS = {"e2b_domain", "e2b_template", "e2b_api_key", "e2b_api_key_env", "sandbox_timeout"}
_COMMON_KEYS = {"type", "default_timeout", "default_language", "memory_limit_mb"}
_FUSION_DEFAULTS = {"default_timeout": 30, "memory_limit_mb": 1024, "rate_limit": 10}  # verl SandboxFusionTool's
_ENV_REF = re.compile(r"^(?:\$\{(?P<oc>oc\.env:)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:,(?P<default>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*))$")
_warned_keys: set[tuple[str, str]] = set()  # (class_name, key) already warned about in this process


def _env_ref(value: Any) -> tuple[str, str | None] | None:
    """`${NAME}`, `$NAME`, `${oc.env:NAME}` or `${oc.env:NAME,default}` -> (NAME, default); else None."""
    if not isinstance(value, str):
        return None
    m = _ENV_REF.match(value.strip())
    if m is None or (m.group("default") is not None and not m.group("oc")):
        return None
    return (m.group("name") or m.group("bare")), m.group("default")


def _string(config: dict, key: str, where: str) -> str:
    """A non-secret string value; an environment reference is read from this process's environment."""
    value = config[key]
    ref = _env_ref(value)
    if ref is not None:
        name, default = ref
        value = os.environ.get(name, default)
        if value is None:
            raise ConfigError(f"{where}: config key '{key}' reads the environment variable {name}, which is not set")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: config key '{key}' must be a non-empty string, got {_json_type(value)}")
    return value.strip()


def _number(config: dict, key: str, where: str, kind: type) -> int | float:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (kind is int and not float(value).is_integer()):
        raise ConfigError(f"{where}: config key '{key}' must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)


def _api_key_env(config: dict, where: str) -> str | None:
    """The environment variable that holds the E2B key; a literal key is refused (and not echoed)."""
    env = config.get("e2b_api_key_env")
    if env is not None and not (isinstance(env, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env)):
        raise ConfigError(f"{where}: config key 'e2b_api_key_env' must be the NAME of an environment variable, e.g. E2B_API_KEY")
    key = config.get("e2b_api_key")
    if key is None or key == "":
        return env
    ref = _env_ref(key)
    if ref is None or ref[1]:  # a literal, or an env reference whose default is a literal
        raise ConfigError(
            f"{where}: config key 'e2b_api_key' holds a literal API key; raytool never copies keys out of config files. "
            "Put the key in an environment variable where the sandbox pools run (export E2B_API_KEY=...) and write "
            "`e2b_api_key: ${E2B_API_KEY}` or `e2b_api_key_env: E2B_API_KEY` instead (and take the key out of this file)"
        )
    if env is not None and env != ref[0]:
        raise ConfigError(f"{where}: e2b_api_key names ${ref[0]} but e2b_api_key_env names {env}; keep one")
    return ref[0]


def _sandbox_overrides(class_name: str, config: dict, where: str) -> dict:
    """The `SandboxConfig` keys a code tool's verl config implies (see the module docstring)."""
    keys = set(config)
    if "sandbox_fusion_url" in keys and keys & (_E2B_KEYS - {"sandbox_timeout"}):
        raise ConfigError(f"{where}: config has both sandbox_fusion_url and e2b_* keys; a code tool runs on one sandbox backend")
    backend = CODE_TOOL_CLASSES.get(class_name)
    if keys & (_E2B_KEYS - {"sandbox_timeout"}):
        backend = "e2b"
    elif "sandbox_fusion_url" in keys:
        backend = "sandbox_fusion"
    if "default_language" in config and str(config["default_language"]).lower() not in ("python", "python3"):
        raise ConfigError(f"{where}: default_language is {config['default_language']!r}; raytool's code interpreter runs Python only")
    if backend == "sandbox_fusion":
        if "sandbox_fusion_url" not in config:
            raise ConfigError(f"{where}: {class_name} needs config key 'sandbox_fusion_url' (the SandboxFusion /run_code endpoint)")
        known = _FUSION_KEYS | _COMMON_KEYS
        config = {**_FUSION_DEFAULTS, **config}
        out = {"backend": "sandbox_fusion", "fusion_url": _string(config, "sandbox_fusion_url", where),
               "timeout_s": _number(config, "default_timeout", where, float), "memory_mb": _number(config, "memory_limit_mb", where, int)}
        if config.get("enable_global_rate_limit", True) is not False:
            out["max_concurrency"] = _number(config, "rate_limit", where, int)
    elif backend == "e2b":
        known = _E2B_KEYS | {"type", "default_timeout", "default_language"}
        out = {"backend": "e2b"}
        if "e2b_domain" in config:
            out["e2b_domain"] = _string(config, "e2b_domain", where)
        if "e2b_template" in config:
            out["e2b_template"] = _string(config, "e2b_template", where)
        if "sandbox_timeout" in config:
            out["e2b_sandbox_timeout_s"] = _number(config, "sandbox_timeout", where, int)
        if "default_timeout" in config:
            out["timeout_s"] = _number(config, "default_timeout", where, float)
        env = _api_key_env(config, where)
        if env is not None:
            out["e2b_api_key_env"] = env
    else:  # raytool's own class with no backend keys: the run's sandbox section decides
        known = _COMMON_KEYS
        out = {}
        if "default_timeout" in config:
            out["timeout_s"] = _number(config, "default_timeout", where, float)
        if "memory_limit_mb" in config:
            out["memory_mb"] = _number(config, "memory_limit_mb", where, int)
    unknown = sorted(k for k in keys - known if (class_name, k) not in _warned_keys)
    if unknown:
        _warned_keys.update((class_name, k) for k in unknown)
        log.warning("%s: config keys %s are not used by raytool's code interpreter and are ignored", where, unknown)
    try:
        msgspec.convert(out, SandboxConfig)
    except msgspec.ValidationError as err:  # a mapping bug here, not the user's
        raise ConfigError(f"{where}: implied sandbox settings {sorted(out)} are not valid SandboxConfig keys: {err}") from None
    return out


def _import_class(path: str, where: str):
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{where}: class_name '{path}' is not an importable `package.module.Class` (or `package.module:Class`)")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"{where}: cannot import module '{module_name}' for class_name '{path}' ({one_line(exc)}); class_name must be an importable "
            f"`package.module.Class`, or a code tool raytool maps itself: {sorted(CODE_TOOL_CLASSES)} "
            "(or any class whose config has sandbox_fusion_url or e2b_* keys)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


@dataclass
class _Entry:
    """One validated `tools[i]` of a verl tool YAML."""

    where: str  # "file: tools[i] (class_name)", the prefix of every error about it
    class_name: str
    config: dict
    schema: dict | None
    is_code: bool


def _parse(source: str | Path | dict) -> tuple[list[_Entry], dict]:
    """The entries of a verl tool YAML (checked, nothing imported) and the sandbox overrides of its code tools."""
    if isinstance(source, dict):
        raw, source_name = source, "tool config"
    else:
        source_name = str(source)
        try:
            raw = yaml.safe_load(Path(source).read_text())
        except OSError as exc:
            raise ConfigError(f"{source_name}: cannot read tool config ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source_name}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tools"), list):
        raise ConfigError(f"{source_name}: expected a mapping with a `tools` list (verl's tool config format)")
    for key in sorted(set(raw) - {"tools"}):
        log.warning("%s: top-level key '%s' is not used by raytool and is ignored", source_name, key)
    entries: list[_Entry] = []
    overrides: dict = {}
    origin: dict[str, int] = {}  # sandbox override key -> index of the tool that set it
    for i, item in enumerate(raw["tools"]):
        where = f"{source_name}: tools[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("class_name"), str) or not item["class_name"].strip():
            raise ConfigError(f"{where}: expected a mapping with a string `class_name`")
        class_name = item["class_name"].strip()
        where = f"{where} ({class_name})"
        config = item.get("config") or {}
        schema = item.get("tool_schema")
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: `config` must be a mapping, got {_json_type(config)}")
        if schema is not None and not isinstance(schema, dict):
            raise ConfigError(f"{where}: `tool_schema` must be a mapping, got {_json_type(schema)}")
        if config.get("type", "native") != "native":
            raise ConfigError(f"{where}: config type {config['type']!r} is not supported; raytool loads `native` tools (no MCP yet)")
        for key in sorted(set(item) - {"class_name", "config", "tool_schema"}):
            log.warning("%s: key '%s' is not used by raytool and is ignored", where, key)
        is_code = class_name in CODE_TOOL_CLASSES or bool(set(config) & ({"sandbox_fusion_url"} | _E2B_KEYS - {"sandbox_timeout"}))
        if is_code:
            if schema is not None:
                try:
                    _check_code_schema(schema)
                except ValueError as exc:
                    raise ConfigError(f"{where}: tool_schema: {exc}") from None
            for key, value in _sandbox_overrides(class_name, config, where).items():
                if key in overrides and overrides[key] != value:
                    raise ConfigError(f"{where}: sandbox setting '{key}' = {value!r} conflicts with {overrides[key]!r} "
                                      f"from tools[{origin[key]}]; all code tools share the run's sandbox")
                overrides[key] = value
                origin.setdefault(key, i)
        entries.append(_Entry(where, class_name, config, schema, is_code))
    return entries, overrides


def tool_config_sandbox_overrides(source: str | Path | dict) -> dict:
    """The `SandboxConfig` keys a verl tool YAML implies, without importing or building its tools."""
    return _parse(source)[1]


def load_tool_config(
    source: str | Path | dict,
    *,
    code_executor: Callable | None = None,
    close_session: Callable | None = None,
    tokenizer: Any = None,
    max_output_tokens: int = 256,
    max_output_chars: int = 1024,
) -> ToolSet:
    """A `ToolSet` from verl's tool YAML (a path, or the same structure as a dict); see the module
    docstring for what each entry becomes. `code_executor(code, session)` / `close_session(session)`
    back the code tools (the SandboxPool calls); without an executor a code call answers
    `sandbox_error` (use `tool_config_sandbox_overrides` to read only the sandbox settings).
    `tokenizer` and the budgets bound what the code tool shows the model."""
    entries, overrides = _parse(source)
    toolset = ToolSet(sandbox_overrides=overrides)
    for e in entries:
        try:
            if e.is_code:
                built = CodeInterpreterTool(
                    code_executor if code_executor is not None else _no_executor,
                    tokenizer=tokenizer,
                    max_output_tokens=max_output_tokens,
                    max_output_chars=max_output_chars,
                    close_session=close_session,
                    schema=e.schema if e.schema is not None else code_schema(),
                )
            else:
                cls = _import_class(e.class_name, e.where)
                try:
                    built = cls(config=dict(e.config), tool_schema=e.schema)
                except Exception as exc:
                    raise ConfigError(f"{e.where}: {e.class_name}(config=..., tool_schema=...) failed: {one_line(exc)}") from None
            toolset.register(built)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:  # a schema without `code`, a non-Tool class, a duplicate name
            raise ConfigError(f"{e.where}: {exc}") from None
    return toolset


async def _no_executor(code: str, session: str):
    raise RuntimeError("this code tool was loaded without a code_executor; pass load_tool_config(..., code_executor=...)")
