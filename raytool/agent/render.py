"""Token-exact chat rendering: prompts through the chat template, observations as template deltas.

Generated tokens are never re-tokenized: what the model saw while generating is what it trains
on. What the loop appends after an assistant turn (an observation) is the text the chat template
puts between that turn's end-of-turn token and the next assistant turn's first token, tokenized on
its own. Templates that merge consecutive tool messages into one turn (Qwen2.5 and Qwen3: one
`<tool_response>` user turn) are handled by rendering all of a turn's observations at once.

Templates are not all prefix-stable: some re-render the last assistant turn once later messages
exist (Qwen3 writes an empty `<think>\n\n</think>\n\n` into the last assistant turn only while it is
last, and strips reasoning from turns before the last user message), some re-render a tool turn once
the next assistant turn exists (Hermes-3). So the observation is not a diff against the rendering of
the conversation so far. It is read off a rendering of the conversation plus the tool messages in
which the last assistant turn holds a unique marker: the text between the marker's end-of-turn token
and the end is exactly what the template writes after that turn, whatever it does to the turn
itself; and the real conversation's rendering must end with that same text (so nothing the template
writes after a turn depends on what the turn said). The generated ids stay verbatim; a template's
re-rendering of what the model already saw is never trained on. After a turn given in parts (its
calls in `tool_calls`: Kimi, Mistral, gpt-oss, whose tool messages may need them), the observation
is what follows the turn's end-of-turn token in the rendering with the tool messages, where the
rendering without them is a prefix of it. Where either check fails,
`observation_text` raises `RenderError` and the agent loop ends the trajectory with finish reason
`render_error`: a wrong observation is never produced silently.

At start-up `ChatRenderer` probes the template with tool-calling conversations (several user turns,
turns with and without reasoning, parallel tool calls) and logs once what it found, naming the
template and the place (`template_report`).

SFT follows the same rules (`sft_examples`): assistant content is trained as written (what the
engine emits), observations come from `observation_text`, and a later user message continues the
same example only where the template's rendering of the prompt extends what came before. Where it
does not (Qwen3 strips earlier reasoning once a new user message comes), the conversation becomes
one example per such user turn, each with the prompt exactly as rollout would render it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid

import msgspec
from jinja2 import TemplateError

from raytool.agent.turns import NEXT_ROLE_ENDS, STRUCTURED, TEMPLATE_TURN_ENDS, TurnError, closes_itself, template_dict, turn_text
from raytool.types import Message, SFTExample

log = logging.getLogger(__name__)


# The start-up probe's findings (text, severe) by template, tools, template kwargs and the format where it probes in parts.
_REPORTS: dict[tuple[str, str, str, str | None], list[tuple[str, bool]]] = {}


class RenderError(Exception):
    """The chat template gives no exact rendering of an observation (the message says where and why)."""


_CALL = '<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({})"}}}}\n</tool_call>'
# The start-up probe: two user turns; assistant turns with and without reasoning; one and two calls per turn.
_PROBE = [
    Message("system", "You are a helpful assistant."),
    Message("user", "What is 2 + 3?"),
    Message("assistant", "<think>\nOne call.\n</think>\n\n" + _CALL.format("2 + 3")),
    Message("tool", "5"),
    Message("assistant", "It is \\boxed{5}."),
    Message("user", "And 4 * 5 and 6 * 7?"),
    Message("assistant", "Two calls.\n" + _CALL.format("4 * 5") + "\n" + _CALL.format("6 * 7")),
    Message("tool", "20"),
    Message("tool", "42"),
    Message("assistant", "<think>\nBoth came back.\n</think>\n\n" + _CALL.format("20 + 42")),
    Message("tool", "62"),
    Message("assistant", "They are \\boxed{20} and \\boxed{42}."),
]


def _probe_call(i: int, expr: str) -> dict:
    return {"id": f"functions.code_interpreter:{i}", "type": "function",
            "function": {"name": "code_interpreter", "arguments": {"code": f"print({expr})"}}}


def _probe_in_parts(with_reasoning: bool, one_call_per_turn: bool) -> list[Message]:
    """The probe for templates that take a call turn in parts (turns.STRUCTURED): the same
    conversation, calls as tool_calls with ids, tool results with their tool_call_id, reasoning as
    reasoning_content where the format has it (and the two calls of message 6 in one turn, or,
    where the format writes one per turn, only the first)."""
    def think(text: str) -> str | None:
        return text if with_reasoning else None

    def result(i: int, text: str) -> Message:
        return Message("tool", text, tool_call_id=_probe_call(i, "")["id"])

    return [
        _PROBE[0], _PROBE[1],
        Message("assistant", "", tool_calls=[_probe_call(0, "2 + 3")], reasoning_content=think("One call.")),
        result(0, "5"), _PROBE[4], _PROBE[5],
        Message("assistant", "", tool_calls=[_probe_call(1, "4 * 5"), _probe_call(2, "6 * 7")][: 1 if one_call_per_turn else 2]),
        result(1, "20"), *([] if one_call_per_turn else [result(2, "42")]),
        Message("assistant", "", tool_calls=[_probe_call(3, "20 + 42")], reasoning_content=think("Both came back.")),
        result(3, "62"), _PROBE[11],
    ]


_INTERPRETER = re.compile(r"\n<interpreter>\n.*?\n</interpreter>\n", re.DOTALL)


def as_in_turn(messages: list[Message]) -> list[Message]:
    """A tool_message-style trace rewritten as the ReTool paper writes it: each run of assistant
    and tool messages becomes one assistant message, tool output inside <interpreter> tags (the
    exact text the in_turn loop splices in). A turn given in parts is written as the retool format
    writes it first; one it cannot write keeps its parts, so that SFT names the row."""
    out: list[Message] = []
    for m in messages:
        if m.role == "assistant" and (m.tool_calls or m.reasoning_content is not None):
            try:
                m = Message("assistant", turn_text("retool", m))
            except TurnError:
                pass
        if m.role == "tool" and out and out[-1].role == "assistant":
            out[-1] = msgspec.structs.replace(out[-1], content=out[-1].content + f"\n<interpreter>\n{m.content}\n</interpreter>\n")
        elif m.role == "assistant" and out and out[-1].role == "assistant" and out[-1].content.endswith("</interpreter>\n"):
            out[-1] = msgspec.structs.replace(out[-1], content=out[-1].content + m.content)
        else:
            out.append(m)
    return out


def _describe(m: Message) -> str:
    if m.role != "assistant":
        return m.role
    return "assistant with reasoning" if "</think>" in m.content or m.reasoning_content else "assistant without reasoning"


def check_template_kwargs(tokenizer, kwargs: dict) -> None:
    """agent.chat_template_kwargs should name variables the model's chat template reads: Jinja takes
    an unknown one silently. One close to a variable the template reads is a typo (`enable_thinkng`
    would leave thinking on): a ConfigError line. Any other is said in a warning line, not refused
    (verl configs pass `enable_thinking: false` to templates that have no thinking mode)."""
    from jinja2 import Environment, TemplateSyntaxError, meta
    from jinja2.ext import loopcontrols

    from raytool.config import ConfigError
    from raytool.errors import did_you_mean

    if not kwargs:
        return
    template = tokenizer.chat_template
    sources = list(template.values()) if isinstance(template, dict) else [template or ""]
    env = Environment(extensions=[loopcontrols])
    try:
        read = set().union(*(meta.find_undeclared_variables(env.parse(source)) for source in sources))
    except TemplateSyntaxError as exc:  # a tag of transformers' own environment ({% generation %}): cannot tell
        log.info("agent.chat_template_kwargs not checked against the chat template (%s)", exc)
        return
    for key in kwargs:
        if key in read:
            continue
        line = f"config key 'agent.chat_template_kwargs': '{key}' is not a variable of the model's chat template"
        typo = did_you_mean(key, read)
        if typo:
            raise ConfigError(f"{line}{typo}; it reads: {', '.join(sorted(read))}")
        log.warning("%s: it has no effect", line)


class ChatRenderer:
    """The chat template of one tokenizer (with the tools it lists and its extra kwargs, e.g.
    Qwen3's `enable_thinking`) as the agent loop and SFT use it. `fmt` (agent.format; None: hermes)
    is how an assistant message given in parts (tool_calls, reasoning_content) is written as the
    tokens the model generates (`raytool.agent.turns`)."""

    def __init__(self, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None, fmt: str | None = None):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.tools = list(tools) if tools else None  # OpenAI-format schemas the template lists
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
        self.name = (f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'} "
                     f"(sha256 {hashlib.sha256(template.encode()).hexdigest()[:12]})")
        try:
            base = self._text([Message("user", "x"), Message("assistant", "y")], add_generation_prompt=False)
        except TemplateError as exc:
            raise ValueError(f"{self.name} cannot render a user and an assistant message"
                             f"{' with these tools' if self.tools else ' without tools'}: {exc}") from None
        if "y" + self.eos_text not in base and not (fmt in NEXT_ROLE_ENDS and base.rstrip().endswith("y")):
            raise ValueError(f"{self.name} does not end assistant turns with the tokenizer's eos token {self.eos_text!r}")
        key = (template, json.dumps(self.tools, sort_keys=True), json.dumps(self.template_kwargs, sort_keys=True, default=str),
               self.fmt if self.fmt in STRUCTURED else None)
        if key not in _REPORTS:  # once per process: SFT data may build a renderer per tool set
            _REPORTS[key] = self.probe()
            for finding, severe in _REPORTS[key]:
                log.log(logging.WARNING if severe else logging.INFO, "%s: %s", self.name, finding)
        self.template_report = [finding for finding, _ in _REPORTS[key]]

    def _text(self, messages, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [template_dict(m, self.fmt) for m in messages], tools=self.tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_kwargs,
            )
        except TemplateError:
            raise
        except Exception as exc:  # a template's own bug (e.g. iterating `tools` when there are none)
            raise TemplateError(f"{type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` exactly as the template would hold it (special tokens kept, no clean-up)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reply_text(self, ids: list[int]) -> str:
        """A generated turn's text without its closing end-of-turn token."""
        return self.decode(ids[:-1] if ids and ids[-1] == self.eos_id else ids)

    def prompt_text(self, messages: list[Message]) -> str:
        return self._text(messages, add_generation_prompt=True)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self.prompt_text(messages))

    def conversation_text(self, messages: list[Message]) -> str:
        return self._text(messages, add_generation_prompt=False)

    # --- observations ----------------------------------------------------------------------------

    def observation_text(self, tool_messages: list[Message], history: list[Message]) -> str:
        """What the template writes between the end-of-turn token of the last assistant turn of
        `history` and the next assistant turn's first token, for all of `tool_messages` at once
        (see the module docstring). Raises `RenderError` where the template gives no exact answer."""
        if not history or history[-1].role != "assistant":
            raise ValueError("observation_text: the history must end with the assistant turn the tools answer")
        if history[-1].tool_calls:
            return self._observation_after_parts(tool_messages, history)
        marker = f"raytool-marker-{uuid.uuid4().hex}"
        try:
            marked = self._text([*history[:-1], Message("assistant", marker), *tool_messages], add_generation_prompt=True)
            real = self._text([*history, *tool_messages], add_generation_prompt=True)
        except TemplateError as exc:
            raise RenderError(f"{self.name} cannot render the tool messages after this turn: {exc}") from None
        at = marked.find(marker)
        # the turn's end: the eos token, or (GLM) the next role's token, which the model generated too
        end = next((t for t in (self.eos_text, *NEXT_ROLE_ENDS.get(self.fmt, ())) if marked.startswith(t, at + len(marker))), None)
        if at < 0 or marked.count(marker) != 1 or end is None:
            raise RenderError(f"{self.name} does not end an assistant turn with the eos token right after its content, "
                              "so the observation cannot be derived exactly")
        observation = marked[at + len(marker) + len(end):]
        # What follows the turn must not depend on what the turn says (the marker stood in for it).
        if not real.endswith(end + observation):
            raise RenderError(f"{self.name} renders the tool messages differently depending on the assistant turn "
                              "before them, so the observation cannot be derived exactly")
        return observation

    def _observation_after_parts(self, tool_messages: list[Message], history: list[Message]) -> str:
        """The observation after a turn given in parts (its calls in tool_calls, which the template's
        tool messages may need: Mistral's ids): what the template writes after the turn's
        end-of-turn token once the tool messages and the next generation prompt come. The turn
        itself is the template's to render (the generated ids stay as they were). The conversation
        before must render the same once the tool messages come, up to the turn itself: a template
        may write the turn differently once it is no longer the last (Qwen3 gives the last turn
        after the user's query an empty <think> block, an earlier one none); the observation is what
        follows the turn's end-of-turn token in the rendering with the tool messages."""
        try:
            before = self._text(history, add_generation_prompt=False)
            real = self._text([*history, *tool_messages], add_generation_prompt=True)
        except TemplateError as exc:
            raise RenderError(f"{self.name} cannot render the tool messages after this turn: {exc}") from None
        if self.fmt in NEXT_ROLE_ENDS:  # GLM: the turn ends with the tool turn's own first token, which the model generated
            token = NEXT_ROLE_ENDS[self.fmt][0]
            if not real.startswith(before):
                raise RenderError(f"{self.name} renders the conversation before the tool messages differently once they come, "
                                  "so the observation cannot be derived exactly")
            if not real.startswith(token, len(before)):
                raise RenderError(f"{self.name} does not open the tool messages with {token!r}, so the observation cannot be derived exactly")
            return real[len(before) + len(token):]
        ends = (self.eos_text, *TEMPLATE_TURN_ENDS.get(self.fmt, ()))
        end, token = max((before.rfind(t), t) for t in ends)
        if end < 0:
            raise RenderError(f"{self.name} writes no end-of-turn token after this turn, so the observation cannot be derived exactly")
        if real.startswith(before):
            return real[end + len(token):]  # what follows the turn's end-of-turn token
        differs = next(k for k, (x, y) in enumerate(zip(before, real)) if x != y)
        turn_start = max((before.rfind(t, 0, end) + len(t) for t in ends if before.rfind(t, 0, end) >= 0), default=0)
        if differs < turn_start:  # an earlier turn changed: the prompt the model saw is not what comes after
            raise RenderError(f"{self.name} renders the conversation before the tool messages differently once they come, "
                              "so the observation cannot be derived exactly")
        at, token = min(((real.find(t, differs), t) for t in ends if real.find(t, differs) >= 0), default=(-1, ""))
        if at < 0:
            raise RenderError(f"{self.name} writes no end-of-turn token after this turn once the tool messages come, "
                              "so the observation cannot be derived exactly")
        return real[at + len(token):]

    def observation_ids(self, tool_messages: list[Message], history: list[Message]) -> list[int]:
        """Tokens between an assistant turn's eos and the next assistant turn's first token."""
        return self.encode(self.observation_text(tool_messages, history))

    # --- assistant turns -------------------------------------------------------------------------

    def assistant_ids(self, content: str) -> list[int]:
        """An assistant turn as the engine would emit it: the content, then the eos token."""
        return self.encode(content) + [self.eos_id]

    def assistant_segments(self, content: str, closed: bool = False) -> list[tuple[list[int], int]]:
        """An assistant turn as the loop records it: (ids, mask) pieces, where in-turn tool output
        (`<interpreter>...</interpreter>` blocks) is tokenized on its own and masked 0; the eos token
        after it unless the turn ends with its own end-of-turn token (`closed`)."""
        pieces, pos = [], 0
        for m in _INTERPRETER.finditer(content):
            if m.start() > pos:
                pieces.append((self.encode(content[pos:m.start()]), 1))
            pieces.append((self.encode(m.group(0)), 0))
            pos = m.end()
        pieces.append((self.encode(content[pos:]) + ([] if closed else [self.eos_id]), 1))
        return pieces

    # --- whole conversations ---------------------------------------------------------------------

    def _closing(self, messages: list[Message], i: int, turn: str) -> str:
        """The token that ends assistant turn `i` as the model generates it: the eos token; none
        where the turn ends with its own (harmony's <|call|>); GLM's turns end with the next role's
        token, <|observation|> before tool output, else <|user|>."""
        if closes_itself(self.fmt, turn):
            return ""
        if self.fmt in NEXT_ROLE_ENDS:
            observation, user = NEXT_ROLE_ENDS[self.fmt]
            return observation if i + 1 < len(messages) and messages[i + 1].role == "tool" else user
        return self.eos_text

    def _walk(self, messages: list[Message]):
        """The conversation as the agent loop would have produced it, piece by piece, as
        (kind, index of the first message it covers, text): "example" where a new example starts
        (its prompt rendered fresh), "assistant" per assistant turn (its text and the token that
        ends it), "observation" per run of tool messages, and "continue" where a later user message
        extends the current example."""
        first = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
        if first is None:
            return
        text = self.prompt_text(messages[:first])
        yield "example", 0, text
        i = first
        while i < len(messages):
            if messages[i].role == "assistant":
                try:
                    turn = turn_text(self.fmt, messages[i])
                except TurnError as exc:
                    raise TurnError(f"messages[{i}]: {exc}") from None
                turn += self._closing(messages, i, turn)
                text += turn
                yield "assistant", i, turn
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j].role != "assistant":
                j += 1
            if j == len(messages):  # trailing non-assistant messages: nothing to learn after them
                return
            if all(m.role == "tool" for m in messages[i:j]):
                delta = self.observation_text(messages[i:j], messages[:i])
                text += delta
                yield "observation", i, delta
            else:
                fresh = self.prompt_text(messages[:j])
                if fresh.startswith(text):
                    yield "continue", i, fresh[len(text):]
                else:  # the template re-renders earlier turns for this prompt: rollout would start here
                    yield "example", i, fresh
                text = fresh
            i = j

    def sft_examples(self, messages: list[Message]) -> list[SFTExample]:
        """Tokenize a trace exactly as the agent loop would have produced it: loss on assistant
        turns, not on tool output (tool messages, or in-turn <interpreter> blocks). One example,
        or one per user turn where the template re-renders earlier turns (see the module docstring)."""
        examples: list[SFTExample] = []
        ids: list[int] = []
        mask: list[int] = []
        for kind, _, text in self._walk(messages):
            if kind == "example":
                if any(mask):
                    examples.append(SFTExample(input_ids=ids, loss_mask=mask))
                ids, mask = [], []
            if kind != "assistant":
                pieces = [(self.encode(text), 0)]
            elif text.endswith(self.eos_text):
                pieces = self.assistant_segments(text[: -len(self.eos_text)])
            else:  # it ends with its own end-of-turn token
                pieces = self.assistant_segments(text, closed=True)
            for piece, m in pieces:
                ids.extend(piece)
                mask.extend([m] * len(piece))
        if any(mask):
            examples.append(SFTExample(input_ids=ids, loss_mask=mask))
        return examples

    # --- the start-up probe ----------------------------------------------------------------------

    def _ignores_tools(self) -> bool:
        """Whether the template renders a prompt the same with the tools as without them (SmolLM2's does)."""
        messages = [template_dict(Message("user", "x"), self.fmt)]
        try:
            with_tools = self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
            without = self.tokenizer.apply_chat_template(messages, tools=None, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
        except Exception:  # a template that needs tools (Hermes-3's tool_use) renders them
            return False
        return with_tools == without

    def probe(self) -> list[tuple[str, bool]]:
        """What this template does to a tool-calling conversation (`_PROBE`): one (finding, severe)
        per place, naming it and what raytool does about it; severe (a warning) where trajectories
        will end with render_error, or where the model cannot see the tools. [] for a prefix-stable template."""
        probe = _probe_in_parts(self.fmt in ("kimi_k2", "gpt_oss"), self.fmt == "gpt_oss") if self.fmt in STRUCTURED else _PROBE
        findings: list[tuple[str, bool]] = []
        if self.tools and self._ignores_tools():
            findings.append(("it does not list the tools in the prompt: the model never sees their names or descriptions "
                             f"({', '.join(t.get('function', t).get('name', '?') for t in self.tools)}); describe them in "
                             "agent.system_prompt, or use a chat template that takes tools", True))
        text, pieces, split, diverged, at = "", [], None, False, 0
        try:
            for kind, i, value in self._walk(probe):
                at = i
                if kind == "example":
                    split = i if text else None
                    text, pieces = "", []
                if kind == "assistant":
                    if split is not None:
                        findings.append((f"the prompt of message {i} re-renders earlier turns once a new user message "
                                         f"comes (message {split}): SFT makes one example per such user turn, its prompt "
                                         "rendered as rollout renders it", False))
                        split = None
                    fresh = self.prompt_text(probe[:i])
                    if fresh != text and not diverged:
                        diverged = True
                        findings.append((f"{_place(fresh, text, pieces, probe)} in the prompt of message {i}: generated tokens "
                                         "are kept as generated, observations are read off the template's rendering "
                                         "after each turn", False))
                pieces.append((len(text), kind, i))
                text += value
            full = self.conversation_text(probe)
        except (RenderError, TurnError) as exc:
            return [*findings, (f"after message {at} of the probe: {exc}; trajectories that reach a tool turn end with "
                                "finish reason render_error", True)]
        except TemplateError as exc:
            return [*findings, (f"the probe conversation cannot be rendered after message {at}: {exc}", True)]
        if not full.startswith(text):
            findings.append((f"{_place(full, text, pieces, probe)} in the finished conversation: raytool trains on the tokens "
                             "as generated, not on this rendering", False))
        return findings


def _place(rendered: str, walked: str, pieces: list[tuple[int, str, int]], probe: list[Message]) -> str:
    """Where the template's rendering first differs from what the model saw, named by the piece of
    `walked` it falls in (`pieces`: offset, kind and first message index of each)."""
    at = next((k for k, (x, y) in enumerate(zip(rendered, walked)) if x != y), min(len(rendered), len(walked)))
    _, kind, i = max((p for p in pieces if p[0] <= at), default=(0, "example", 0))
    where = {"assistant": f"message {i} ({_describe(probe[i])})", "observation": f"the tool turn from message {i}",
             "continue": f"the user turn at message {i}"}.get(kind, "the prompt")
    return f"{where} renders as {rendered[at:at + 24]!r} where the model saw {walked[at:at + 24]!r}"
