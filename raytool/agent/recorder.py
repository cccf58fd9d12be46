"""Token-exact recording of an agent that talks to the model in messages (a LangGraph agent through
`raytool.agent.langchain_adapter`, any OpenAI-API agent through `raytool.agent.gateway`).

Token-exact: a turn's generated ids are recorded verbatim (mask 1, the engine's log-probs). On the
next call the history is rendered again; the text of everything recorded so far must be a prefix of
that rendering, and only the new tail (tool outputs and template glue) is tokenized, as an
observation (mask 0, log-prob 0.0). The engine is given the recorded ids plus that tail, never a
re-tokenization of earlier turns. The prefix holds because an assistant turn this model produced is
rendered from its raw generated text (the adapters keep it and put it back), not from its parsed
tool calls.

If the agent rewrites its history (trims, summarizes or drops messages) the rendering no longer
extends the recording. Re-tokenizing would train on tokens the engine never produced, so recording
stops there: the trajectory keeps what was recorded, its finish_reason is "history_rewritten" (the
pipeline's finish/history_rewritten metric), and `agent.on_history_rewrite` says how it trains:
`truncate` (the recorded part) or `drop` (nothing: every token masked). The model goes on answering
the agent, unrecorded, so the agent's own control flow is unchanged.
"""

from __future__ import annotations

import logging
import os

from raytool.agent.ledger import TokenLedger
from raytool.agent.render import ChatRenderer
from raytool.types import Message, TokenOutput, Trajectory

log = logging.getLogger(__name__)

HISTORY_REWRITTEN = "history_rewritten"


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None) -> str:
    """The chat template's text of `messages` (with `tools` listed), ending in the assistant generation prompt."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))


class TokenRecorder:
    """One trajectory across an agent's model calls, in a TokenLedger: the prompt, then generated
    ids (mask 1) and observation ids (mask 0) in order, as the engine saw them."""

    def __init__(self, renderer: ChatRenderer, max_response_tokens: int | None = None, on_rewrite: str = "truncate"):
        self.renderer = renderer
        self.max_response_tokens = max_response_tokens
        self.on_rewrite = on_rewrite  # agent.on_history_rewrite: "truncate" or "drop"
        self.ledger = TokenLedger()
        self.num_calls = 0  # model calls, recorded or not
        self.num_turns = 0  # recorded generated turns
        self.tool_calls = 0
        self.malformed_calls = 0
        self.rewrites = 0  # calls whose history did not extend the recording (0 or 1: recording stops)
        self.stopped = ""  # why recording stopped: "" (recording), HISTORY_REWRITTEN or "length"
        self._text = ""  # the text of everything recorded
        self._last_finish = ""  # the engine's finish reason of the last recorded turn
        self._last_called_tools = False

    def next_prompt(self, rendered: str) -> list[int] | None:
        """The ids to generate from, given the rendered history; None when the token budget is spent."""
        self.num_calls += 1
        if self.num_calls == 1:
            self.ledger.prompt_ids = self.renderer.encode(rendered)
            self._text = rendered
            return self.ledger.context()
        if self.stopped == "length":
            return None
        if self.stopped:  # history rewritten earlier: serve the agent, record nothing
            return self.renderer.encode(rendered)
        if not rendered.startswith(self._text):
            self.stopped = HISTORY_REWRITTEN
            self.rewrites += 1
            at = len(os.path.commonprefix([rendered, self._text]))
            log.warning("agent rewrote its history: the rendering differs from the recording at char %d (%r vs %r); "
                        "recording stops after %d turns", at, rendered[at:at + 40], self._text[at:at + 40],
                        self.num_turns)
            return self.renderer.encode(rendered)
        obs = self.renderer.encode(rendered[len(self._text):])
        if self.max_response_tokens is not None and len(self.ledger.response_ids) + len(obs) >= self.max_response_tokens:
            self.stopped = "length"  # as AgentLoop: an observation that leaves no room to answer is not added
            return None
        self.ledger.observed(obs)
        self._text = rendered
        return self.ledger.context()

    def tokens_left(self) -> int | None:
        return None if self.max_response_tokens is None else self.max_response_tokens - len(self.ledger.response_ids)

    def record(self, out: TokenOutput) -> str:
        """Append a generation verbatim (if recording); returns its text without the trailing eos."""
        ids = out.token_ids
        if not self.stopped:
            self.ledger.generated(out)
            self._text += self.renderer.decode(ids)
            self.num_turns += 1
            self._last_finish = out.finish_reason
        return self.renderer.reply_text(ids)

    def count_tool_calls(self, parsed: int, malformed: int) -> None:
        self.tool_calls += parsed + malformed
        self.malformed_calls += malformed
        if not self.stopped:
            self._last_called_tools = parsed > 0

    def finish_reason(self) -> str:
        if self.stopped:
            return self.stopped
        if self._last_finish != "stop":
            return self._last_finish or "no_turns"
        # A last turn with tool calls: the agent ended before the model read their output (step limit, return_direct).
        return "max_turns" if self._last_called_tools else "answer"

    def to_trajectory(self, uid: str, group_id: str, messages: list[Message], ground_truth: str, *, failed_tools: int = 0) -> Trajectory:
        """The recorded trajectory; `messages` is the agent's final conversation. After a rewritten
        history with `on_rewrite="drop"` every token is masked out of the loss (its reward still
        counts in its group's baseline); "truncate" trains on what was recorded up to the rewrite."""
        return self.ledger.trajectory(uid, group_id, messages, ground_truth,
                                      train=not (self.stopped == HISTORY_REWRITTEN and self.on_rewrite == "drop"),
                                      num_turns=self.num_turns, tool_calls=self.tool_calls, tool_errors=self.malformed_calls + failed_tools,
                                      finish_reason=self.finish_reason())
