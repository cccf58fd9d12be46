"""Tools the agent may call: the `Tool` interface, the code interpreter, Python functions as tools,
and `ToolSet` / `load_tool_config` (verl's tool YAML)."""

from raytool.tools.base import ERROR_KINDS, Tool, ToolContext, ToolResult
from raytool.tools.code_interpreter import CodeInterpreterTool, OutputBudget, code_schema, format_exec_result
from raytool.tools.registry import FunctionTool, ToolSet, function_tool, load_tool_config, tool, tool_config_sandbox_overrides

__all__ = [
    "ERROR_KINDS",
    "Tool",
    "ToolContext",
    "ToolResult",
    "CodeInterpreterTool",
    "OutputBudget",
    "code_schema",
    "format_exec_result",
    "FunctionTool",
    "ToolSet",
    "function_tool",
    "load_tool_config",
    "tool",
    "tool_config_sandbox_overrides",
]
