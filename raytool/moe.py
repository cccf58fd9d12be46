"""Mixture-of-experts routing: which experts each router picked, recorded and replayed.

An MoE model's router sends each token, in each layer, to its top-k experts. Inference engines
and trainers compute router logits with different kernels and batch shapes, so near-ties break
differently and the trainer's forward can route a token to other experts than the engine did: its
log-probs and gradients are then of another computation than the one that sampled the token.
Rollout router replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers") records the engine's top-k indices per token and layer and makes
the trainer's forward use them; the gate weights still come from the trainer's own router
(softmax over all experts, taken at the replayed indices), so the router keeps learning. R2
replays the trainer's own old-policy routing in later updates of a batch.

`RouterTap` wraps the routers of transformers' softmax-top-k family (Qwen2-MoE, Qwen3-MoE, OLMoE,
Mixtral: each returns router logits, top-k weights and top-k indices) and can record what they
pick, replay given picks (-1: the router's own), and count expert load. The HF engine records with
it; the trainer replays with it. Routes travel as `raytool.types.Routes` ([tokens, layers, k]).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import numpy as np

from raytool.types import Routes

if TYPE_CHECKING:  # torch is imported where a model is: agent workers assemble routes without it
    import torch

# transformers' routers that pick top-k of a softmax: (logits, top-k weights, top-k indices) = router(hidden)
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")
NO_ROUTE = -1  # a position whose route is unknown: the router picks as usual


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's replayable routers in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def moe_classes_without_replay(model: torch.nn.Module) -> list[str]:
    """Router-like modules of other MoE families (e.g. DeepSeek's grouped routing), which
    `RouterTap` cannot replay: their names, for the error."""
    return sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "Router", "Gate"))
                   and type(m).__name__ not in ROUTER_CLASSES})


class RouterTap:
    """Installs itself on every router of `model`. Per forward:

    - `replay` ([N, layers, k] long, N = the forward's flattened tokens, NO_ROUTE where unknown): the
      routers use these experts; `differs`/`compared` count (token, layer) pairs whose own top-k
      set would have differed from the replayed one (while `counting`).
    - `recording` (a list per layer): each call's picks ([N, k]) are appended to its layer's list.
    - `counting`, with `valid` ([N] bool, False on padding): `load` ([layers, experts]) sums the
      tokens per expert, and replayed forwards add to `differs`/`compared`.
    - `balancing`: each layer's router probabilities and picks are kept (with their graph) for
      `balance_loss()`.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("the model has no router raytool can record or replay")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        self.replay: torch.Tensor | None = None
        self.recording: list[list[torch.Tensor]] | None = None
        self.counting = False
        self.valid: torch.Tensor | None = None
        self.differs: torch.Tensor | None = None  # summed on the device: no read-back per micro-batch
        self.compared: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self.balancing = False
        self.kept: list[tuple] = []  # (probs [N, E], picks [N, k]) per layer, while balancing
        for layer, router in enumerate(self.routers):
            router.forward = types.MethodType(_routing_forward(self, layer), router)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def start_recording(self) -> None:
        self.recording = [[] for _ in self.routers]

    def stop_recording(self) -> list[list[torch.Tensor]]:
        recorded, self.recording = self.recording or [], None
        return recorded

    def reset_counts(self) -> None:
        self.differs = self.compared = self.load = None

    def _pick(self, layer: int, probs: torch.Tensor) -> torch.Tensor:
        import torch

        own = torch.topk(probs, self.top_k, dim=-1).indices
        if self.replay is None:
            return own
        given = self.replay[:, layer].to(own.device)
        if given.size(0) != own.size(0):
            raise RuntimeError(f"router replay: {given.size(0)} routed tokens given for a forward of {own.size(0)}")
        known = given[:, :1] >= 0
        if self.counting:
            self._count_differences(own, given, known)
        return torch.where(known, given, own)

    def _count_differences(self, own, given, known) -> None:
        import torch

        with torch.no_grad():
            if self.valid is not None:
                known = known & self.valid.to(known.device)[:, None]
            changed = (own.sort(-1).values != given.sort(-1).values).any(-1) & known[:, 0]
            self.differs = changed.sum() + (0 if self.differs is None else self.differs)
            self.compared = known.sum() + (0 if self.compared is None else self.compared)

    def balance_loss(self) -> torch.Tensor:
        """The load-balancing loss of the forward kept, as transformers defines it for these models
        (Switch Transformers, Fedus et al. 2021, eq. 4, over top-k picks; `load_balancing_loss_func`):
        experts x sum over experts of (its picks per valid token, over every layer and top-k slot) x
        (its mean router probability over every layer's valid tokens). k when perfectly balanced."""
        import torch

        probs = torch.cat([p for p, _ in self.kept])  # [layers * N, experts]
        picks = torch.cat([k for _, k in self.kept])  # [layers * N, k]
        self.kept = []
        valid = torch.ones(probs.size(0), dtype=probs.dtype, device=probs.device)
        if self.valid is not None:
            valid = self.valid.to(probs.device, probs.dtype).repeat(self.num_layers)
        tokens = valid.sum().clamp(min=1.0)
        weights = valid[:, None].expand_as(picks).reshape(-1)
        picked = torch.zeros(self.num_experts, dtype=probs.dtype, device=probs.device).scatter_add_(0, picks.reshape(-1), weights)
        mean_prob = (probs * valid[:, None]).sum(0) / tokens
        return self.num_experts * ((picked / tokens) * mean_prob).sum()

    def _note(self, layer: int, picks: torch.Tensor) -> None:
        import torch

        if self.recording is not None:
            self.recording[layer].append(picks.detach())
        if self.counting:
            with torch.no_grad():  # a scatter, not bincount or a boolean index: neither reads back from the device
                weights = torch.ones(picks.shape, dtype=torch.float64, device=picks.device)
                if self.valid is not None:
                    weights *= self.valid.to(picks.device)[:, None]
                if self.load is None:
                    self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=picks.device)
                self.load[layer].scatter_add_(0, picks.reshape(-1), weights.reshape(-1))


def _routing_forward(tap: RouterTap, layer: int):
    """The router's forward as transformers writes it (softmax in float32, top-k, renormalised
    where the model does), with the top-k indices from `tap` where it replays."""
    import torch
    import torch.nn.functional as F

    keep_float = None

    def forward(router, hidden_states):
        nonlocal keep_float
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        picks = tap._pick(layer, probs)
        tap._note(layer, picks)
        if tap.balancing:
            tap.kept.append((probs, picks))
        weights = probs.gather(-1, picks)
        if getattr(router, "norm_topk_prob", True):  # Mixtral has no flag: it always renormalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if keep_float is None:
            keep_float = type(router).__name__ == "MixtralTopKRouter"  # Mixtral returns float32 weights
        return logits, (weights if keep_float else weights.to(logits.dtype)), picks

    return forward


# -- routes of sequences ----------------------------------------------------------------------------


def routes_array(routes: Routes | None, length: int, num_layers: int, top_k: int) -> np.ndarray | None:
    """`routes` as an int16 [length, layers, k] array (NO_ROUTE where they do not reach), or None
    when they are absent or of another model's shape."""
    if routes is None or routes.layers != num_layers or routes.top_k != top_k:
        return None
    given = routes.array()
    out = np.full((length, num_layers, top_k), NO_ROUTE, dtype=np.int16)
    end = min(length, routes.start + given.shape[0])
    if end > routes.start:
        out[routes.start:end] = given[: end - routes.start]
    return out


def covers(routes: np.ndarray, scored: list[int]) -> bool:
    """Whether every position up to the last scored one has its route (the log-prob of the token
    after position t depends on the routing of every position <= t)."""
    if not scored:
        return True
    return bool((routes[: max(scored) + 1, :, 0] >= 0).all())


def token_slots(lengths: list[int], packed: bool) -> tuple[list[int], int]:
    """Where each sequence starts among a forward's flattened tokens, and how many there are:
    packed end to end, or in padded rows of the longest length (as raytool.training.batching lays
    them out)."""
    row = None if packed else max(lengths)
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n if packed else row
    return starts, at


def valid_tokens(lengths: list[int], packed: bool) -> np.ndarray:
    """[flattened tokens] bool: False on padding."""
    starts, total = token_slots(lengths, packed)
    valid = np.zeros(total, dtype=bool)
    for start, n in zip(starts, lengths):
        valid[start:start + n] = True
    return valid


def replay_tensor(routes: list[np.ndarray | None], lengths: list[int], packed: bool, top_k: int, num_layers: int) -> torch.Tensor:
    """Per-sequence routes laid out as a forward flattens its tokens (NO_ROUTE on padding and on
    sequences without routes)."""
    import torch

    starts, total = token_slots(lengths, packed)
    out = np.full((total, num_layers, top_k), NO_ROUTE, dtype=np.int64)
    for r, start, n in zip(routes, starts, lengths):
        if r is not None:
            out[start:start + n] = r[:n]
    return torch.from_numpy(out)


def split_recording(recording: list[list[torch.Tensor]], lengths: list[int], packed: bool) -> list[np.ndarray]:
    """One forward's recorded picks (per layer, one [N, k] tensor) back into per-sequence
    [length, layers, k] arrays."""
    import torch

    picks = torch.stack([calls[-1] for calls in recording], dim=1).cpu().numpy().astype(np.int16)  # [N, layers, k]
    starts, _ = token_slots(lengths, packed)
    return [picks[start:start + n].copy() for start, n in zip(starts, lengths)]


def load_imbalance(load: torch.Tensor) -> float:
    """Mean over layers of the busiest expert's tokens over the mean expert's (1: balanced)."""
    mean = load.mean(dim=1).clamp(min=1e-12)
    return float((load.max(dim=1).values / mean).mean())


class RouteLog:
    """A trajectory's routes, assembled from its generate calls (or a request's parts): each call's
    routes cover the positions it forwarded, and a position keeps the routes of the call that
    first computed it. That is what produced its tokens' log-probs, and what a later turn read
    when the engine reused the position's cached keys and values (vLLM's prefix cache; a partial
    rollout continued on new weights keeps the routes each version computed)."""

    def __init__(self):
        self.picks: np.ndarray | None = None  # [positions, layers, k]

    def add(self, routes: Routes | None) -> None:
        if routes is None:
            return
        given = routes.array()
        end = routes.start + given.shape[0]
        if self.picks is None or self.picks.shape[1:] != given.shape[1:]:
            self.picks = np.full((end, *given.shape[1:]), NO_ROUTE, dtype=np.int16)
            self.picks[routes.start:end] = given
            return
        known = self.picks.shape[0]
        if known < end:
            grown = np.full((end, *given.shape[1:]), NO_ROUTE, dtype=np.int16)
            grown[:known] = self.picks
            self.picks = grown
        span = self.picks[routes.start:end]
        unknown = span[:, :, 0] < 0
        span[unknown] = given[unknown]

    def routes(self) -> Routes | None:
        return None if self.picks is None else Routes.of(self.picks)
