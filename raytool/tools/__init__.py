"""Tools the agent may call: the `Tool` interface and the code interpreter."""

from raytool.tools.base import Tool, ToolContext, ToolResult
from raytool.tools.code_interpreter import CodeInterpreterTool, format_exec_result

__all__ = ["Tool", "ToolContext", "ToolResult", "CodeInterpreterTool", "format_exec_result"]
