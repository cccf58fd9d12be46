"""Token-exact chat rendering: prompts through the chat template, observations as template deltas.

Generated tokens are never re-tokenized. What the loop appends after an assistant turn is the text
the chat template adds between "the conversation so far" and "the conversation plus the new
messages" (up to the next assistant turn's first token), tokenized on its own: so prompt +
generated + observation ids decode to the template's rendering of the whole conversation, and
equal its tokenization wherever the template is prefix-stable.

Templates are not always prefix-stable. A template that renders a past assistant turn differently
once later turns exist (Qwen3 strips earlier reasoning), or whose rendering of the prompt changes
when the conversation grows, makes training see different tokens than inference did.
`ChatRenderer` probes the template at start-up with a tool-calling conversation and reports each
such place (`stability_problems`, logged as a warning). Templates that merge consecutive tool
messages into one turn (Qwen2.5: one `<tool_response>` user turn) are handled by rendering all of a
turn's observations in one delta, never one message at a time.
"""

from __future__ import annotations

import logging
import re

from raytool.types import Message, SFTExample

log = logging.getLogger(__name__)

# A fixed conversation for measuring deltas when the real one cannot be used; its content does not matter.
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
# The probe conversation of the start-up stability check: a tool-calling exchange with two calls in a turn.
_PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3, and 4 * 5?"},
    {"role": "assistant", "content": "<think>two calls</think>Let me compute.\n<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(2 + 3)\"}}\n</tool_call>"},
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "20"},
    {"role": "assistant", "content": "<think>done</think>The answers are \\boxed{5} and \\boxed{20}."},
]


_INTERPRETER = re.compile(r"\n<interpreter>\n.*?\n</interpreter>\n", re.DOTALL)


def as_in_turn(messages: list[Message]) -> list[Message]:
    """A tool_message-style trace rewritten as the ReTool paper writes it: each run of assistant
    and tool messages becomes one assistant message, tool output inside <interpreter> tags (the
    exact text the in_turn loop splices in)."""
    out: list[Message] = []
    for m in messages:
        if m.role == "tool" and out and out[-1].role == "assistant":
            out[-1] = Message("assistant", out[-1].content + f"\n<interpreter>\n{m.content}\n</interpreter>\n")
        elif m.role == "assistant" and out and out[-1].role == "assistant" and out[-1].content.endswith("</interpreter>\n"):
            out[-1] = Message("assistant", out[-1].content + m.content)
        else:
            out.append(m)
    return out


def _as_dict(m) -> dict:
    return m if isinstance(m, dict) else {"role": m.role, "content": m.content}


class ChatRenderer:
    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None  # OpenAI-format schemas the template lists
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token
        base = self._text(_BASE, add_generation_prompt=False)
        end = base.rfind(self.eos_text)
        if end < 0:
            raise ValueError("chat template does not end assistant turns with the tokenizer's eos token")
        # Text the template writes after the assistant's end-of-turn token (e.g. "\n").
        self._after_eos = base[end + len(self.eos_text):]
        self._base_len = len(base)
        self.stability_problems = self.check_prefix_stability()
        for problem in self.stability_problems:
            log.warning("chat template is not prefix-stable: %s", problem)

    def _text(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [_as_dict(m) for m in messages], tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt,
        )

    def check_prefix_stability(self) -> list[str]:
        """Where the template breaks "each render extends the previous one" on a tool-calling probe."""
        problems = []
        full = self._text(_PROBE, add_generation_prompt=False)
        prompt = self._text(_PROBE[:2], add_generation_prompt=True)
        if not full.startswith(prompt):
            problems.append("the prompt renders differently once the conversation goes on")
        first_turn = self._text(_PROBE[:3], add_generation_prompt=False)
        if not full.startswith(first_turn):
            problems.append("a past assistant turn renders differently once later turns exist (e.g. earlier reasoning is "
                            "stripped): trained tokens differ from what the model saw while generating")
        with_obs = self._text(_PROBE[:5], add_generation_prompt=True)
        if not with_obs.startswith(first_turn):
            problems.append("appending tool messages re-renders the assistant turn before them")
        elif not full.startswith(with_obs):
            problems.append("the tool observations render differently once the next assistant turn exists")
        return problems

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self._text(messages, add_generation_prompt=True))

    def observation_text(self, tool_messages: list[Message], history: list[Message] | None = None) -> str:
        """What the template puts between the last assistant turn's eos and the next assistant
        turn's first token, for all of `tool_messages` at once.

        With `history` (the conversation so far, ending with that assistant turn) the delta is
        measured against the real conversation, so templates whose rendering of a tool message
        depends on what precedes it render it as they will in training; without it (or where the
        real conversation is not prefix-stable) against a fixed stand-in conversation.
        """
        if history:
            before = self._text(history, add_generation_prompt=False)
            after = self._text([*history, *tool_messages], add_generation_prompt=True)
            end = before.rfind(self.eos_text)
            if end >= 0 and after.startswith(before):
                return before[end + len(self.eos_text):] + after[len(before):]
        full = self._text([*_BASE, *tool_messages], add_generation_prompt=True)
        return self._after_eos + full[self._base_len:]

    def observation_ids(self, tool_messages: list[Message], history: list[Message] | None = None) -> list[int]:
        """Tokens between an assistant turn's eos and the next assistant turn's first token."""
        return self.encode(self.observation_text(tool_messages, history))

    def assistant_ids(self, content: str) -> list[int]:
        """An assistant turn as the engine would emit it: the content, then the eos token."""
        return self.encode(content) + [self.eos_id]

    def conversation_text(self, messages: list[Message]) -> str:
        return self._text(messages, add_generation_prompt=False)

    def assistant_segments(self, content: str) -> list[tuple[list[int], int]]:
        """An assistant turn as the loop records it: (ids, mask) pieces, where in-turn tool output
        (`<interpreter>...</interpreter>` blocks) is tokenized on its own and masked 0."""
        pieces, pos = [], 0
        for m in _INTERPRETER.finditer(content):
            if m.start() > pos:
                pieces.append((self.encode(content[pos:m.start()]), 1))
            pieces.append((self.encode(m.group(0)), 0))
            pos = m.end()
        pieces.append((self.encode(content[pos:]) + [self.eos_id], 1))
        return pieces

    def sft_example(self, messages: list[Message]) -> SFTExample:
        """Tokenize a trace exactly as the agent loop would have produced it; loss on assistant
        turns, not on tool output (tool messages, or in-turn <interpreter> blocks)."""
        first_reply = next(i for i, m in enumerate(messages) if m.role == "assistant")
        ids = self.prompt_ids(messages[:first_reply])
        mask = [0] * len(ids)
        i = first_reply
        while i < len(messages):
            if messages[i].role == "assistant":
                for piece, m in self.assistant_segments(messages[i].content):
                    ids += piece
                    mask += [m] * len(piece)
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j].role != "assistant":
                j += 1
            if j == len(messages):  # trailing non-assistant messages: nothing to learn after them
                break
            obs = self.observation_ids(messages[i:j], messages[:i])
            ids += obs
            mask += [0] * len(obs)
            i = j
        return SFTExample(input_ids=ids, loss_mask=mask)
