"""Datasets and prompt loading: the generated tool-arithmetic task and a resumable prompt loader."""

from raytool.data.conversations import Conversation, DataError, load_conversations, sft_examples, split_validation
from raytool.data.loader import PromptLoader
from raytool.data.tool_arith import Problem, make_splits, sft_messages

__all__ = ["PromptLoader", "Problem", "make_splits", "sft_messages"]
__all__ += ["Conversation", "DataError", "load_conversations", "sft_examples", "split_validation"]
