"""The judge tests' scripted judge (raytool.bench.judge_server) and a verdict that checks the answer."""

from __future__ import annotations

from raytool.bench.judge_server import JudgeServer

__all__ = ["JudgeServer", "grade"]


def grade(prompt: str) -> str:
    """A judge that checks the answer it is shown against the reference."""
    answer = prompt.split("Answer to grade:")[1].split("Judge whether")[0]
    return "Matches the reference.\nScore: 9" if "42" in answer else "Wrong result.\nScore: 2"
