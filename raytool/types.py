"""Wire types: msgspec Structs for everything that crosses a process, actor or file boundary."""

from __future__ import annotations

from typing import Literal

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    """How one generate call samples. `stop_token_ids` and `stop` strings end generation and are
    kept in the output."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    priority: int = 0  # the engine's scheduling priority, lower first (vLLM with priority scheduling; other engines ignore it): a run's judge calls to its own servers go first


FinishReason = Literal["stop", "length", "abort"]


class ServerHealth(msgspec.Struct, frozen=True):
    """A rollout server's answer to a health probe (it raises instead when its engine failed)."""

    server: str
    policy_version: int  # the weights its engine holds
    in_flight: int
    uptime_s: float
    pid: int


class ServerProgress(msgspec.Struct, frozen=True):
    """How long a server's engine has gone without a token while requests wait (0 while idle or
    loading weights): a stalled server is told from a busy one by it."""

    server: str
    in_flight: int
    idle_s: float


class Routes(msgspec.Struct, frozen=True):
    """Which experts a mixture-of-experts model routed each token to: top-k expert indices per
    token and layer for the positions start, start + 1, ... of a sequence, as little-endian bytes
    (int16; -1 where unknown): compact on the wire (a 4k-token, 48-layer, top-8 sequence: 3 MiB)."""

    start: int
    layers: int
    top_k: int
    data: bytes

    @classmethod
    def of(cls, picks, start: int = 0) -> "Routes":
        """From a [tokens, layers, k] integer array."""
        import numpy as np

        picks = np.asarray(picks)
        return cls(start=start, layers=picks.shape[1], top_k=picks.shape[2], data=picks.astype("<i2").tobytes())

    def array(self):
        """The [tokens, layers, k] int16 array."""
        import numpy as np

        return np.frombuffer(self.data, dtype="<i2").reshape(-1, self.layers, self.top_k)


class TokenOutput(msgspec.Struct):
    """What an engine returns: the sampled ids verbatim and the log-prob of each under the sampler."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    server: str = ""  # which rollout server produced it (for metrics and debugging)
    policy_version: int = 0  # the version the engine held when the request ended
    versions: list[int] = []  # the policy version that produced each token ([]: all policy_version)
    server_in_flight: int = 0  # requests the server still held when it answered (for the callers' routers)
    routes: Routes | None = None  # MoE with trainer.router_replay=r3: the experts the engine routed the prompt and output tokens to

    def token_versions(self) -> list[int]:
        return list(self.versions) if self.versions else [self.policy_version] * len(self.token_ids)


class PromptScores(msgspec.Struct):
    """A server's log-probs of a whole token sequence under its weights (no generation): a teacher's
    word on a student's tokens (distill.teacher)."""

    logprobs: list[float]  # log p(ids[t] | ids[:t]) for t >= 1: aligned with ids[1:]
    server: str = ""
    policy_version: int = 0
    server_in_flight: int = 0


class ToolCall(msgspec.Struct):
    name: str
    arguments: dict


class Message(msgspec.Struct, omit_defaults=True):
    """One chat message as the chat template takes it. `content` is the text; the structured fields
    are for templates that write them themselves: an assistant turn's `tool_calls` (OpenAI's form:
    {id, type: function, function: {name, arguments}}) and `reasoning_content`, a tool message's
    `tool_call_id`. None: not given (left out of what the template sees)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """The message as a chat template takes it (the fields that are None left out)."""
        d = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "reasoning_content", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d


ExecStatus = Literal["ok", "error", "timeout", "oom", "killed", "infra_error"]


class ExecResult(msgspec.Struct):
    status: ExecStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    truncated: bool = False
    queue_s: float = 0.0  # seconds the cell waited for a slot of its sandbox pool before it ran (raytool.overload)


class Trajectory(msgspec.Struct):
    """One finished rollout: the prompt, every token after it, and which of those the loss sees.

    `response_ids` are the generated tokens and the tool-observation tokens in order;
    `response_mask` is 1 on generated tokens and 0 on observation tokens; `rollout_logprobs` is
    the engine's log-prob of each response token (0.0 on observation tokens).
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    rollout_logprobs: list[float]
    messages: list[Message]
    ground_truth: str
    reward: float = 0.0
    reward_extra: dict = {}
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_kinds: dict[str, int] = {}  # tool_errors by kind (raytool.tools.base.ERROR_KINDS)
    tool_repaired: int = 0  # calls that parsed only after an unambiguous repair
    tool_cut_in_fence: int = 0  # retool code blocks ended by a </code> inside their still-open ``` fence
    finish_reason: str = ""
    policy_version: int = 0  # the version of the last generate call
    response_versions: list[int] = []  # aligned with response_ids: the policy version that produced each generated token (-1 on observation tokens; []: all policy_version)
    agent_name: str = ""  # the agent loop that produced it
    agent_error: str = ""  # an agent function (agent_name openai) that raised: the first line of its exception
    infra_failure: str = ""  # why it failed through no fault of the policy (a sandbox, engine, reward or worker failure; "": it did not): never trained as the policy's mistake
    turns: list[dict] = []  # the trace: per generate call its text, tokens, timing, tool calls and their outputs
    timings: dict[str, float] = {}
    routes: Routes | None = None  # MoE with trainer.router_replay=r3: the engine's experts for prompt_ids + response_ids (raytool.moe)
    teacher_logprobs: list[float] | None = None  # distill.teacher: the teacher's log-prob of each response token (0.0 on observation tokens)


# The finish reason of a trajectory stopped by its wall-clock limit (agent.max_trajectory_s). It is
# truncated, not answered: it is not scored, and training leaves it out of the loss and of its
# group's advantage statistics (a slow sandbox or a long, still-reasoning response is not a wrong
# answer; scoring it as one would bias training against long reasoning).
TIME_LIMIT = "time_limit"


ACC_THRESHOLD = 1.0  # a reward without its own `acc`: correct when its score reaches this (a correct answer's score in verl's and raytool's math rewards)


def accuracy(reward: float, extra: dict) -> tuple[float, bool]:
    """A trajectory's accuracy -> (1.0 or 0.0, whether it came from the score): the reward fn's
    own `acc` where it gives one, else score >= ACC_THRESHOLD."""
    if "acc" in extra:
        return float(extra["acc"]), False
    return float(reward >= ACC_THRESHOLD), True


def trained(finish_reason: str) -> bool:
    """Whether a trajectory that finished so takes part in the policy update (`TIME_LIMIT`: not)."""
    return finish_reason != TIME_LIMIT


def generated_versions(t: Trajectory) -> list[int]:
    """The policy version of each generated (mask 1) token of `t`, in order."""
    if not t.response_versions:
        return [t.policy_version] * sum(t.response_mask)
    return [v for v, m in zip(t.response_versions, t.response_mask) if m]


class TrainSequence(msgspec.Struct, frozen=True):
    """What the trainer trains on from one trajectory, and nothing else: its tokens (prompt, then
    response) and, for each token after the first, whether the loss sees it and the engine's
    log-prob of it (0.0 where the loss does not see it). The agent worker builds it beside the
    trajectory; the trainer ranks fetch only these (no text, no trace, no reward)."""

    ids: list[int]
    mask: list[int]  # aligned with ids[1:]: 1 on generated tokens
    logprobs: list[float]  # aligned with ids[1:]: the engine's (the behaviour policy's)
    routes: Routes | None = None  # MoE with trainer.router_replay=r3: the engine's experts for ids
    teacher: list[float] | None = None  # distill.teacher: aligned with ids[1:], the teacher's log-prob of each trained token (0.0 elsewhere)

    @classmethod
    def of(cls, t: Trajectory) -> "TrainSequence":
        before = len(t.prompt_ids) - 1  # prompt tokens the loss never sees (the first predicts nothing)
        teacher = [0.0] * before + list(t.teacher_logprobs) if t.teacher_logprobs is not None else None
        return cls(t.prompt_ids + t.response_ids, [0] * before + list(t.response_mask), [0.0] * before + list(t.rollout_logprobs), t.routes, teacher)


class TrainBatch(msgspec.Struct):
    """One trainer rank's part of an update: its own sequences with their places in the batch, and
    the whole batch's rewards (they travel once, here), group of each trajectory and whether it is
    trained (`trained`): every rank computes the batch's advantages alike from these."""

    sequences: list[TrainSequence]
    index: list[int]  # the place of each own sequence in the batch
    rewards: list[float]
    groups: list[int]
    trained: list[bool]

    @classmethod
    def whole(cls, trajectories: list[Trajectory]) -> "TrainBatch":
        """Every trajectory of a batch, for one process that trains on it whole (a single rank, tests, benches)."""
        numbers: dict[str, int] = {}
        return cls([TrainSequence.of(t) for t in trajectories], list(range(len(trajectories))), [t.reward for t in trajectories],
                   [numbers.setdefault(t.group_id, len(numbers)) for t in trajectories], [trained(t.finish_reason) for t in trajectories])


class SFTExample(msgspec.Struct):
    """A tokenized supervised example: loss on positions where `loss_mask` is 1."""

    input_ids: list[int]
    loss_mask: list[int]


class Datum(msgspec.Struct, frozen=True):
    """A sequence with a loss of the caller's own (the Tinker API's `Datum`): the model reads
    `tokens`; position t predicts `targets[t]`; `inputs` are the loss's per-position values by name
    (weights, the sampler's log-probs, advantages), each as long as `tokens`."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, list[float]] = {}
