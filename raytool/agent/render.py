"""Token-exact chat rendering: prompts through the chat template, observations as template deltas.

Generated tokens are never re-tokenized. What the loop appends after an assistant turn is the
exact text the chat template would put between that turn's end-of-turn token and the start of the
next assistant turn, tokenized on its own: so prompt + generated + observation ids decode to the
template's rendering of the whole conversation.
"""

from __future__ import annotations

from raytool.types import Message, SFTExample

# A fixed conversation the observation delta is measured against; its content does not matter.
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token
        base = self._text(_BASE, add_generation_prompt=False)
        end = base.rfind(self.eos_text)
        if end < 0:
            raise ValueError("chat template does not end assistant turns with the tokenizer's eos token")
        # Text the template writes after the assistant's end-of-turn token (e.g. "\n").
        self._after_eos = base[end + len(self.eos_text):]
        self._base_len = len(base)
        extended = self._text([*_BASE, {"role": "tool", "content": "z"}], add_generation_prompt=True)
        if not extended.startswith(base):
            # Observation deltas assume appending a message never re-renders earlier ones.
            raise ValueError("chat template re-renders earlier turns when a message is appended; "
                             "token-exact observation deltas are impossible with it")

    def _text(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self._text(messages, add_generation_prompt=True))

    def observation_text(self, tool_messages: list[Message]) -> str:
        full = self._text([*_BASE, *tool_messages], add_generation_prompt=True)
        return self._after_eos + full[self._base_len:]

    def observation_ids(self, tool_messages: list[Message]) -> list[int]:
        """Tokens between an assistant turn's eos and the next assistant turn's first token."""
        return self.encode(self.observation_text(tool_messages))

    def assistant_ids(self, content: str) -> list[int]:
        """An assistant turn as the engine would emit it: the content, then the eos token."""
        return self.encode(content) + [self.eos_id]

    def conversation_text(self, messages: list[Message]) -> str:
        return self._text(messages, add_generation_prompt=False)

    def sft_example(self, messages: list[Message]) -> SFTExample:
        """Tokenize a trace exactly as the agent loop would have produced it; loss on assistant turns."""
        first_reply = next(i for i, m in enumerate(messages) if m.role == "assistant")
        ids = self.prompt_ids(messages[:first_reply])
        mask = [0] * len(ids)
        i = first_reply
        while i < len(messages):
            if messages[i].role == "assistant":
                turn = self.assistant_ids(messages[i].content)
                ids += turn
                mask += [1] * len(turn)
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j].role != "assistant":
                j += 1
            obs = self.observation_ids(messages[i:j])
            if j == len(messages):  # trailing non-assistant messages: nothing to learn after them
                break
            ids += obs
            mask += [0] * len(obs)
            i = j
        return SFTExample(input_ids=ids, loss_mask=mask)
