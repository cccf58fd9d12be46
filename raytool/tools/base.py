"""The Tool interface: an OpenAI-format schema plus `async execute(call, ctx) -> ToolResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from raytool.types import ToolCall


@dataclass
class ToolContext:
    trajectory_id: str
    extra: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    text: str  # what the model sees as the tool message
    ok: bool  # False counts as a tool error in the metrics
    metrics: dict = field(default_factory=dict)


class Tool(Protocol):
    name: str
    schema: dict

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult: ...
