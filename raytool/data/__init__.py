"""Datasets and prompt loading: the generated tool-arithmetic task and a resumable prompt loader."""

from raytool.data.loader import PromptLoader
from raytool.data.tool_arith import Problem, make_splits, sft_messages

__all__ = ["PromptLoader", "Problem", "make_splits", "sft_messages"]
