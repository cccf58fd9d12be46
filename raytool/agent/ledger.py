"""The token ledger of one trajectory: the prompt, then every token after it in the order the
engine saw them, generated (mask 1, the engine's log-prob and policy version) or observed (tool
output and template glue: mask 0, log-prob 0.0, version -1). It is the one place a `Trajectory` is
built: the native agent loop (raytool.agent.loop) and the recorder of message-level agents
(raytool.agent.recorder: the gateway, LangGraph) both write to one, so token-exact training is
written once."""

from __future__ import annotations

from raytool.moe import RouteLog
from raytool.types import Message, TokenOutput, Trajectory


class TokenLedger:
    def __init__(self, prompt_ids: list[int] | None = None):
        self.prompt_ids: list[int] = list(prompt_ids or [])
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # per response token: the policy version that generated it (-1: observation)
        self.policy_version = 0  # of the last generation
        self.routes = RouteLog()  # MoE: the experts the engine routed each position to (r3)

    def generated(self, out: TokenOutput) -> None:
        """The engine's ids verbatim, with their log-probs, versions and (MoE) routes."""
        self.response_ids += out.token_ids
        self.mask += [1] * len(out.token_ids)
        self.logprobs += out.logprobs
        self.versions += out.token_versions()
        self.policy_version = out.policy_version
        self.routes.add(out.routes)

    def observed(self, ids: list[int]) -> None:
        """Tokens the policy did not generate: out of the loss."""
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def context(self) -> list[int]:
        """What the engine generates from next: the prompt and everything after it."""
        return self.prompt_ids + self.response_ids

    def trajectory(self, uid: str, group_id: str, messages: list[Message], ground_truth: str, *, train: bool = True,
                   **summary) -> Trajectory:
        """The trajectory of what was recorded; `train=False` masks every token out of the loss (its
        reward still counts in its group's baseline). `summary`: the loop's counts, finish reason,
        trace and timings (Trajectory's fields)."""
        return Trajectory(uid=uid, group_id=group_id, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                          response_mask=list(self.mask) if train else [0] * len(self.mask), rollout_logprobs=list(self.logprobs),
                          response_versions=list(self.versions), messages=list(messages), ground_truth=ground_truth,
                          policy_version=self.policy_version, routes=self.routes.routes(), **summary)
