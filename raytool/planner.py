"""`raytool plan`: the memory a run needs, per role, before any actor starts.

From the model's architecture (its config.json; for the recipes' models, a table when the
checkpoint is not on this machine) and the config, it predicts for one trainer worker and one
rollout server the accelerator and host memory, part by part, and checks them against a cluster
shape (nodes, accelerators per node, accelerator and host memory: flags, else the config's
cluster.* keys, else this machine). It counts the accelerators each role takes against the
cluster's, as Ray would place them. When something does not fit it says in one line which config
key to change; its verdict is the first line of the table.

The model (bytes; P parameters, P_t of them trained, W trainer workers, SP sequence-parallel
size, T = trainer.micro_batch_tokens / SP tokens on a rank, c the compute dtype's size):
- trainer states: fp32 masters 4P, gradients 4P_t, AdamW moments 8P_t, sharded over W (on the
  host with trainer.cpu_offload), and a KL reference's 4P when a KL term is on (not with LoRA).
- FSDP2 unsharded copies: the root (embeddings, head) in the compute dtype while it runs, and
  two decoder layers (the running one and the prefetched one) in the compute dtype, plus their
  fp32 gradients before the reduce-scatter.
- activations: per decoder layer and token, what backward keeps: each of the two RMSNorms its
  fp32 input and fp32 normalized values and their cast (8h + c h bytes: HF norms compute in fp32),
  attention's rotated q, k and v and its output (q + 2kv + q values), o_proj's contiguous input
  (q), the MLP's gate, up, activation and product (4I): 2(8 + c)h + c(3q + 2kv + 4I) bytes. With
  activation checkpointing only each layer's input (h values), plus one layer's full set while it
  is recomputed.
- the LM head: one chunk of min(trainer.logprob_chunk_tokens, T) x vocabulary fp32 logits, kept
  for backward, and their gradient.
- rank 0 reads the fp32 checkpoint into host memory while loading (4P); the other ranks only
  their shards. Its HF export (raytool.training.export) holds at most one open shard, safetensors'
  serialized copy of it, and the full tensor being gathered in fp32 and in the export dtype; a
  mixture of experts' export (not streamed) holds the model in model.dtype.
- a node's host: the trainer ranks placed on it (the trainer's placement group packs them: as many
  as its accelerators hold), rank 0's larger peak of loading and export, the rollout servers on the
  accelerators left, and what Ray's object store holds (the trajectories of the steps in flight,
  48 bytes a token at the longest; weights go over ZMQ, not through it).
- a rollout server: weights 2P/TP (model.dtype), KV cache 2 x layers x kv x 2 bytes per token
  per TP rank, in gpu_memory_utilization of each accelerator.
- fixed costs: an accelerator's context and allocator slack (1 GiB), a process's Python, torch
  and transformers with the model's code imported (0.4 GiB of host memory, measured here).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from raytool import placement
from raytool.config import RunConfig
from raytool.device import engine_dtype
from raytool.distill import teacher_run
from raytool.errors import RaytoolError
from raytool.weightsync.collective import auto_backend, weights_device
from raytool.training.sequence_parallel import check_heads

GiB = 1024**3
OBJECT_STORE_SHARE, OBJECT_STORE_MAX = 0.3, 200e9  # Ray's default object store: 30% of a node's memory, at most 200 GB (ray_constants)
TRAJECTORY_BYTES_PER_TOKEN = 48  # a pickled Trajectory: token id, log-prob, mask and version per token, and its trace's text
ACCELERATOR_RESERVE = 1 * GiB  # CUDA/CANN context, cuBLAS workspace, allocator slack
NF4_BYTES = 0.5 + 0.127 / 8  # bitsandbytes NF4 with double quantization: 4 bits a weight plus 0.127 bits of block scales
PROCESS_BASE = 0.4 * GiB  # a trainer or engine process's interpreter, torch and transformers (435 MB resident on this CPU)
# trainer.micro_batch_tokens auto: on a CPU (the measured default here) and on an accelerator,
# where a 4,096-token micro-batch leaves a 1.5B model's step bound by the host (measured on an
# H100: 12.2k tokens/s at 4,096, 23.6k at 16,384 with checkpointing)
AUTO_MICRO_BATCH_TOKENS = {False: 4096, True: 16384}
# trainer.activation_checkpointing auto on an accelerator stays off while the trainer's predicted
# total without it is within this share of its memory (the prediction's tolerance is 15-20%)
CHECKPOINTING_HEADROOM = 0.8


@dataclass(frozen=True)
class Architecture:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    source: str = ""  # where these figures come from
    # Mixture of experts (Qwen3-MoE's, Mixtral's layout: every layer's MLP is `experts` SwiGLU experts
    # of `expert_intermediate`, `experts_per_token` of them per token, and a linear router); 0: dense.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return h * q + 2 * h * kv + q * h + 2 * h + ((q + 2 * kv) if self.qkv_bias else 0)

    def expert_params(self, experts: int) -> int:
        """`experts` SwiGLU experts of one layer."""
        return experts * 3 * self.hidden * self.expert_intermediate

    def mlp_params(self, active: bool = False) -> int:
        """One layer's MLP: the dense SwiGLU, or every expert and the router (`active`: the experts a token uses)."""
        if not self.moe:
            return 3 * self.hidden * self.intermediate
        return self.expert_params(self.experts_per_token if active else self.experts) + self.hidden * self.experts

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params()

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.root_params() + self.layers * self.layer_params()

    def active_params(self) -> int:
        """The parameters one token's forward uses (all of them for a dense model)."""
        return self.root_params() + self.layers * (self.attention_params() + self.mlp_params(active=True))

    def activation_intermediate(self) -> int:
        """The MLP width one token's activations span: the dense intermediate, or its experts' together."""
        return self.experts_per_token * self.expert_intermediate if self.moe else self.intermediate

    def lora_params(self, rank: int) -> int:
        """Adapters on every linear layer of the decoder (peft's all-linear): r x (in + out) each. In a
        mixture of experts as peft 0.21 adapts transformers' fused experts: the router at rank r, each
        layer's experts' gate-and-up projection at rank 2r and their down projection at rank r per
        expert, (in + out) each (tests/test_planner.py checks it against peft)."""
        h, q, kv, e, ei = self.hidden, self.q_dim, self.kv_dim, self.experts, self.expert_intermediate
        mlp = (h + e) + e * 2 * (h + 2 * ei) + e * (ei + h) if self.moe else 3 * (h + self.intermediate)
        return self.layers * rank * ((h + q) + 2 * (h + kv) + (q + h) + mlp)


# The recipes' models, for planning on a machine that does not hold their checkpoints (their
# config.json figures). A local checkpoint's own config.json always wins.
KNOWN = {
    "Qwen2.5-32B-Instruct": dict(hidden=5120, layers=64, heads=40, kv_heads=8, head_dim=128, intermediate=27648, vocab=152064, tied=False, qkv_bias=True),
    "Qwen2.5-7B-Instruct": dict(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied=False, qkv_bias=True),
    "Qwen2.5-1.5B-Instruct": dict(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936, tied=True, qkv_bias=True),
    "Qwen3-4B": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tied=True),
    "Qwen3-4B-Instruct-2507": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936, tied=True),
    # Qwen3's mixtures of experts: 128 experts, 8 per token (30.5B total, 3.3B active; 235B, 22B active)
    "Qwen3-30B-A3B": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144, vocab=151936, tied=False,
                          experts=128, experts_per_token=8, expert_intermediate=768),
    "Qwen3-235B-A22B": dict(hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, intermediate=12288, vocab=151936, tied=False,
                            experts=128, experts_per_token=8, expert_intermediate=1536),
}


def architecture(model_path: str) -> Architecture:
    """From the checkpoint's config.json (a built-in name is resolved, and built, first), else from KNOWN by directory name."""
    from raytool.models import BUILTIN, resolve_model

    path = Path(resolve_model(model_path)) if model_path in BUILTIN else Path(model_path).expanduser()
    if (path / "config.json").is_file():
        c = json.loads((path / "config.json").read_text())
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0  # Qwen3-MoE, Mixtral, DeepSeek
        return Architecture(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                            head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                            tied=bool(c.get("tie_word_embeddings", False)), qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
                            source=str(path / "config.json"), experts=experts, experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
                            expert_intermediate=(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0)
    name = path.name
    if name in KNOWN:
        return Architecture(**KNOWN[name], source=f"raytool's table for {name} (no config.json at {model_path})")
    raise FileNotFoundError(f"model.path '{model_path}': no config.json there, and raytool knows no architecture named '{name}' "
                            f"(known: {', '.join(sorted(KNOWN))}); plan on a machine that holds the checkpoint")


DEFAULT_LINK_GBIT = 100.0  # cluster.link_gbit unset: one NIC of a common GPU cluster


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int  # accelerators per node (0: CPU only)
    gpu_memory_gb: float
    host_memory_gb: float
    link_gbit: float = DEFAULT_LINK_GBIT  # bandwidth between nodes (the weight sync's predicted time)

    @classmethod
    def this_machine(cls) -> "Cluster":
        """This node: its accelerators as torch sees them, its physical memory."""
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
        try:
            import torch

            if torch.cuda.is_available():
                from raytool.device import accelerator_memory

                return cls(1, torch.cuda.device_count(), accelerator_memory(torch.device("cuda", 0)) / GiB, host)
        except ImportError:
            pass
        return cls(1, 0, 0.0, host)


class PlanInputError(RaytoolError):
    """A cluster shape no cluster has (no nodes, negative accelerators or memory): one line naming the flag or config key."""


# A Cluster field: its `raytool plan` flag, what a real cluster has, and that in words
SHAPE = {
    "nodes": ("--nodes", lambda v: v >= 1, "at least 1 node"),
    "gpus_per_node": ("--gpus-per-node", lambda v: v >= 0, "0 or more accelerators (0: CPU nodes)"),
    "gpu_memory_gb": ("--gpu-memory-gb", lambda v: v >= 0, "0 or more GiB (0: not known)"),
    "host_memory_gb": ("--host-memory-gb", lambda v: v > 0, "more than 0 GiB"),
    "link_gbit": ("--link-gbit", lambda v: v > 0, "more than 0 Gbit/s"),
}


def cluster_shape(cfg: RunConfig, flags: dict[str, float | None]) -> Cluster:
    """The cluster `raytool plan` checks against: each figure from its flag, else from the
    config's cluster.* key, else this machine's (one node). An impossible figure is a
    PlanInputError naming the flag or key it came from."""
    here = None
    shape = {}
    for name, (flag, possible, expected) in SHAPE.items():
        value, source = flags.get(name), flag
        if value is None:
            value, source = getattr(cfg.cluster, name), f"config key 'cluster.{name}'"
        if value is None:
            here = here or Cluster.this_machine()
            value = getattr(here, name)
        elif not possible(value):  # `not`: NaN is no size either
            raise PlanInputError(f"{source}: expected {expected}, got {value:g}")
        shape[name] = value
    return Cluster(**shape)


def accelerator_demands(cfg: RunConfig, with_servers: bool = True) -> list[placement.Demand]:
    """What each role takes of the nodes' accelerators: a trainer worker trainer.num_gpus, a
    rollout server rollout.num_gpus, or with vLLM at least tensor_parallel_size (its engine
    shards the model over that many accelerators, all on the server's node)."""
    t, acc = cfg.trainer, cfg.cluster.accelerator

    def per_server(r) -> float:
        return max(r.num_gpus, r.tensor_parallel_size) if r.num_gpus and r.engine == "vllm" and r.tensor_parallel_size > 1 else r.num_gpus

    wanted = [placement.Demand("rollout server", cfg.rollout.num_servers, {acc: per_server(cfg.rollout)},
                               "rollout.num_servers, rollout.num_gpus, rollout.tensor_parallel_size")] if with_servers else []
    if with_servers and cfg.distill.has_servers:
        teacher = teacher_run(cfg).rollout
        wanted.append(placement.Demand("teacher server", teacher.num_servers, {acc: per_server(teacher)},
                                       "distill.num_servers, distill.num_gpus, distill.tensor_parallel_size"))
    wanted.append(placement.Demand("trainer worker", t.num_workers, {acc: t.num_gpus}, "trainer.num_workers, trainer.num_gpus"))
    return [d for d in wanted if d.count and d.bundle[acc]]


def accelerator_shortfall(cfg: RunConfig, cluster: Cluster, with_servers: bool = True) -> str | None:
    """Why the run's accelerators cannot be placed on `cluster` (one line), or None."""
    acc = cfg.cluster.accelerator
    nodes = [{acc: float(cluster.gpus_per_node)} for _ in range(cluster.nodes)]
    reason = placement.shortfall(accelerator_demands(cfg, with_servers), nodes)
    if reason is None:
        return None
    return (f"{reason}; the cluster is {cluster.nodes} node(s) x {cluster.gpus_per_node} {acc}s "
            f"(cluster.nodes x cluster.gpus_per_node, or --nodes x --gpus-per-node)")


@dataclass
class RoleMemory:
    role: str
    count: int
    accelerator: dict[str, float] = field(default_factory=dict)  # part -> bytes, on one accelerator (empty on CPU runs)
    host: dict[str, float] = field(default_factory=dict)  # part -> bytes, in its process's host memory
    kv_tokens: int | None = None  # a rollout server on accelerators: tokens its KV cache holds

    @property
    def accelerator_total(self) -> float:
        return sum(self.accelerator.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


@dataclass
class Plan:
    model: str
    architecture: Architecture
    params: int
    trained_params: int
    cluster: Cluster
    roles: list[RoleMemory]
    problems: list[str]  # one line each: what does not fit and the key to change
    loading: float = 0.0  # rank 0's extra host memory while it loads the checkpoint
    notes: list[str] = field(default_factory=list)  # the "auto" settings decided for this cluster, one line each
    accelerators: dict[str, float] = field(default_factory=dict)  # role -> the accelerators all its actors take
    accelerator: str = "GPU"  # what they are (cluster.accelerator)
    export: float = 0.0  # rank 0's extra host memory while it writes the HF export
    object_store: float = 0.0  # Ray's object store on each node
    trainers_per_node: int = 0  # trainer ranks on the busiest node (the placement group packs them)
    servers_per_node: int = 0  # rollout servers on that node
    weight_sync: dict[str, float] = field(default_factory=dict)  # backend -> predicted seconds of one sync between nodes
    sync_warning: str = ""  # the run's backend is predicted to miss trainer.weight_sync_timeout_s

    def to_json(self) -> dict:
        out = asdict(self)
        out["fits"] = not self.problems
        return out


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


# What a weight sync between nodes reaches, for its predicted time (not measured on a cluster here:
# docs/scaling.md). One TCP stream through host memory (ZMQ's relay chain, gloo) tops out at a few
# GB/s whatever the link; NCCL and HCCL broadcasts drive the link from device memory (verl reports
# Qwen3-30B-A3B, 61 GB in bf16, in about 7 s over InfiniBand with NCCL: ~8.7 GB/s).
TCP_STREAM_GBYTES = 3.0
COLLECTIVE_LINK_SHARE = 0.8


def sync_prediction(cfg: RunConfig, arch: Architecture, link_gbit: float) -> tuple[dict[str, float], str]:
    """backend -> predicted seconds of one full sync to servers on other nodes at `link_gbit`, and a
    warning where the run's backend would miss trainer.weight_sync_timeout_s ("" if not)."""
    gbytes = arch.params() * _bytes(engine_dtype(cfg.model.dtype, cfg.rollout.num_gpus > 0, engine="hf")[0]) / 1e9
    link = link_gbit / 8
    device = weights_device(cfg)
    on_accelerators = device != "cpu"
    seconds = {"zmq": gbytes / min(link, TCP_STREAM_GBYTES),
               "collective": gbytes / (link * COLLECTIVE_LINK_SHARE if on_accelerators else min(link, TCP_STREAM_GBYTES))}
    backend = cfg.trainer.weight_sync_backend
    if backend == "auto":  # the cluster's image has its accelerators' backend, whatever this machine's torch has
        backend = auto_backend(device, backend_available=True)
    deadline = cfg.trainer.weight_sync_timeout_s
    warning = ""
    if seconds[backend] > deadline:
        warning = (f"weight sync: {gbytes:.1f} GB by {backend} at {link_gbit:g} Gbit/s (cluster.link_gbit) is predicted to take "
                   f"{seconds[backend]:.0f}s, more than trainer.weight_sync_timeout_s={deadline:g}: raise it"
                   + (", or set trainer.weight_sync_backend=collective" if backend == "zmq" and on_accelerators else ""))
    return {k: round(v, 2) for k, v in seconds.items()}, warning


def trainer_memory(cfg: RunConfig, arch: Architecture, on_accelerator: bool) -> RoleMemory:
    """One trainer worker; `on_accelerator`: its compute memory is an accelerator's (else all host memory)."""
    t = cfg.trainer
    world, sp = t.num_workers, t.sequence_parallel_size
    p = arch.params()
    trained = arch.lora_params(t.lora_rank) if t.lora_rank else p
    if t.compute_dtype != "auto":
        c = _bytes(t.compute_dtype)
    else:  # as raytool.training.trainer.compute_dtype decides it (on a CPU: this machine's)
        from raytool.device import cpu_bf16_support

        c = 2 if on_accelerator or cpu_bf16_support()[0] else 4
    tokens = -(-t.micro_batch_tokens // sp)
    h, q, kv, i = arch.hidden, arch.q_dim, arch.kv_dim, arch.activation_intermediate()
    full_layer = (2 * (8 + c) * h + c * (3 * q + 2 * kv + 4 * i) + 4 * arch.experts) * tokens  # (MoE: the router's fp32 logits)
    states = {"fp32 master weights": 4 * p / world, "fp32 gradients": 4 * trained / world, "AdamW moments": 8 * trained / world}
    if t.load_in_4bit:  # QLoRA, one worker: the base is NF4 (4 bits, double-quantized scales) but for the root, in the compute dtype
        states = {"NF4 base (decoder linear layers)": arch.layers * arch.layer_params() * NF4_BYTES, "base root (embeddings, head)": arch.root_params() * c,
                  "fp32 adapters": 4 * trained, "fp32 adapter gradients": 4 * trained, "AdamW moments": 8 * trained}
    a = cfg.algorithm
    if (a.kl_loss_coef > 0 or a.kl_reward_coef > 0) and not t.lora_rank:  # LoRA's reference is the base model, adapters off
        states["KL reference (fp32, sharded)"] = 4 * p / world
    if t.load_in_4bit:
        compute = {"one linear layer dequantized": max(h * i, h * q) * c}
    else:
        compute = {
            "unsharded root (embeddings, head)": arch.root_params() * c,
            "unsharded layers (running + prefetched)": 2 * arch.layer_params() * c,
            "unsharded layer gradients (fp32, before reduce-scatter)": 2 * arch.layer_params() * 4 * (trained / p),
        }
    if t.activation_checkpointing:
        compute["activations (checkpointed layer inputs)"] = arch.layers * h * c * tokens
        compute["activations (one layer recomputed)"] = full_layer
    else:
        compute["activations"] = arch.layers * full_layer
    chunk = min(t.logprob_chunk_tokens, tokens)
    compute["LM head chunk (fp32 logits and their gradient)"] = 2 * chunk * arch.vocab * 4
    role = RoleMemory("trainer worker", world)
    if on_accelerator:
        (role.host if t.cpu_offload else role.accelerator).update(states)
        role.accelerator.update(compute)
        role.accelerator["context and allocator slack"] = ACCELERATOR_RESERVE
    else:
        role.host.update(states)
        role.host.update(compute)
    role.host["process (Python, torch, transformers)"] = PROCESS_BASE
    return role


def trainer_budget(cfg: RunConfig, accelerator_bytes: float, with_servers: bool = True) -> float:
    """The accelerator memory a trainer worker may use: all of it, or what a rollout engine
    sharing its accelerator leaves (both roles with fractional GPUs)."""
    if with_servers and cfg.trainer.num_gpus < 1 and cfg.rollout.num_gpus < 1:
        return accelerator_bytes * (1 - cfg.rollout.gpu_memory_utilization)
    return accelerator_bytes


def resolve_auto(cfg: RunConfig, arch: Architecture, on_accelerator: bool, accelerator_bytes: float = 0.0,
                 with_servers: bool = True) -> tuple[RunConfig, list[str]]:
    """`cfg` with trainer.micro_batch_tokens, trainer.activation_checkpointing, trainer.compile and
    trainer.kernels "auto" decided for where the trainer runs, and one line per decision. Checkpointing on an
    accelerator is on only when the trainer's predicted memory without it exceeds
    CHECKPOINTING_HEADROOM of its budget (or the accelerator's memory is not known): it recomputes
    every layer's forward, about a third more compute, to fit a long micro-batch. Compile is on for
    CUDA GPUs (1.45x on an H100, the 1.5B shape) where it can run: not on NPUs (inductor has no
    backend), with sequence parallelism or a 4-bit base; off on CPUs, where a model of SmolLM2's
    size gained about 6% for a long first step. The trainer and the planner decide alike."""
    t = cfg.trainer
    notes = []
    tokens, checkpointing = t.micro_batch_tokens, t.activation_checkpointing
    if tokens == "auto":
        tokens = AUTO_MICRO_BATCH_TOKENS[on_accelerator]
        notes.append(f"trainer.micro_batch_tokens auto: {tokens} (on {'an accelerator' if on_accelerator else 'a CPU'})")
    without = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(t, micro_batch_tokens=tokens, activation_checkpointing=False))
    if checkpointing == "auto":
        if not on_accelerator:
            checkpointing, why = False, "on a CPU"
        elif accelerator_bytes <= 0:
            checkpointing, why = True, "the accelerator's memory is not known"
        else:
            need, budget = trainer_memory(without, arch, True).accelerator_total, trainer_budget(cfg, accelerator_bytes, with_servers)
            checkpointing, why = need > CHECKPOINTING_HEADROOM * budget, f"without it a trainer worker needs {_gib(need)} of its {_gib(budget)}"
        notes.append(f"trainer.activation_checkpointing auto: {'on' if checkpointing else 'off'} ({why})")
    compiled = t.compile
    if compiled == "auto":
        cuda = on_accelerator and cfg.cluster.accelerator == "GPU"
        compiled = cuda and t.sequence_parallel_size == 1 and not t.load_in_4bit and t.router_replay == "off"
        why = ("a CUDA GPU" if compiled else "on a CPU" if not on_accelerator else "inductor has no NPU backend" if not cuda
               else "sequence parallelism" if t.sequence_parallel_size > 1 else "a 4-bit base" if t.load_in_4bit else "router replay")
        notes.append(f"trainer.compile auto: {'on' if compiled else 'off'} ({why})")
    kernels = t.kernels
    if kernels == "auto":
        # Off until measured: Liger-Kernel's RMSNorm, SwiGLU and RoPE have not been timed against
        # the compiled layers (which fuse the same elementwise work) on a GPU yet.
        kernels = False
        notes.append("trainer.kernels auto: off (" + ("Liger-Kernel's fused kernels are not yet measured to pay on a GPU; true turns them on"
                                                     if on_accelerator and cfg.cluster.accelerator == "GPU" else
                                                     "on a CPU" if not on_accelerator else "Triton kernels for CUDA GPUs") + ")")
    return msgspec.structs.replace(without, trainer=msgspec.structs.replace(without.trainer, activation_checkpointing=checkpointing,
                                                                            compile=compiled, kernels=kernels)), notes


def export_peak(arch: Architecture, dtype: str) -> float:
    """Rank 0's extra host memory while it writes the HF export (see the module's docstring)."""
    from raytool.training.export import MAX_SHARD_BYTES

    if arch.moe:
        return arch.params() * _bytes(dtype)
    largest = max(arch.vocab * arch.hidden, arch.intermediate * arch.hidden, arch.q_dim * arch.hidden)
    shard = min(MAX_SHARD_BYTES, arch.params() * _bytes(dtype))  # a model smaller than one shard is one file
    return 2 * shard + largest * (4 + _bytes(dtype))


def object_store(cfg: RunConfig, host_memory: float) -> float:
    """What the run keeps in Ray's object store on a node: the trajectories of the steps in flight
    (a step's batch, and as many more as async.max_staleness lets run ahead), at most the store's
    default size (30% of the node's memory, at most 200 GB). Weights do not go through it (ZMQ)."""
    tokens = cfg.data.prompts_per_step * cfg.rollout.n * (cfg.rollout.max_model_len or 2 * cfg.agent.max_response_tokens)
    return min(tokens * TRAJECTORY_BYTES_PER_TOKEN * (1 + cfg.async_.max_staleness), OBJECT_STORE_SHARE * host_memory, OBJECT_STORE_MAX)


def busiest_node(cfg: RunConfig, cluster: Cluster, trainer_acc: bool, server_acc: bool, with_servers: bool) -> tuple[int, int]:
    """(trainer ranks, rollout servers) on the node that holds the most of them: the trainer's
    placement group packs its ranks (as many to a node as its accelerators take), the servers
    take the accelerators left there; without accelerators, each role spreads evenly."""
    t, r = cfg.trainer, cfg.rollout
    nodes, per_node = max(cluster.nodes, 1), cluster.gpus_per_node
    trainers = min(t.num_workers, int(per_node // t.num_gpus)) if trainer_acc and per_node >= t.num_gpus > 0 else -(-t.num_workers // nodes)
    if not with_servers:
        return trainers, 0
    if server_acc and r.num_gpus > 0:
        left = per_node - (trainers * t.num_gpus if trainer_acc else 0)
        return trainers, min(r.num_servers, max(0, int(left // r.num_gpus)))
    return trainers, -(-r.num_servers // nodes)


def teachers_on_busiest_node(cfg: RunConfig, cluster: Cluster, trainers: int, servers: int, trainer_acc: bool) -> int:
    """distill.teacher: the teacher servers on the busiest node (`busiest_node`'s): on accelerators,
    as many as the accelerators its trainer ranks and rollout servers leave there take; without,
    spread evenly like the other roles."""
    teacher = teacher_run(cfg).rollout
    if teacher.num_gpus > 0 and cluster.gpus_per_node > 0:
        left = cluster.gpus_per_node - (trainers * cfg.trainer.num_gpus if trainer_acc else 0) - servers * cfg.rollout.num_gpus
        return min(teacher.num_servers, max(0, int(left // teacher.num_gpus)))
    return -(-teacher.num_servers // max(cluster.nodes, 1))


def loading_peak(arch: Architecture, four_bit: bool = False) -> float:
    """Rank 0's extra host memory while it reads the fp32 checkpoint and broadcasts it (a 4-bit
    base goes to the GPU one tensor at a time: the largest, the embeddings in bf16)."""
    return 2 * arch.vocab * arch.hidden if four_bit else 4 * arch.params()


def server_memory(cfg: RunConfig, arch: Architecture, on_accelerator: bool, gpu_memory: float) -> RoleMemory:
    r = cfg.rollout
    tp = r.tensor_parallel_size
    weight_bytes = _bytes(engine_dtype(cfg.model.dtype, on_accelerator, engine="hf")[0])  # no vLLM import: its dtype check is the run's
    role = RoleMemory("rollout server", r.num_servers)
    weights = arch.params() * weight_bytes / tp
    if on_accelerator:
        role.accelerator["weights (per TP rank)"] = weights
        role.accelerator["KV cache and activations (the rest of gpu_memory_utilization)"] = max(0.0, r.gpu_memory_utilization * gpu_memory - weights)
        role.host["process (Python, torch, vLLM)"] = PROCESS_BASE * tp
    else:
        role.host["weights"] = weights
        role.host["KV cache (rollout.cpu_kv_cache_gb)"] = r.cpu_kv_cache_gb * GiB
        role.host["process (Python, torch, vLLM)"] = PROCESS_BASE
    return role


def kv_cache_problems(r, arch: Architecture, role: RoleMemory, gpu_memory: float, tp_key: str) -> list[str]:
    """A server on accelerators (rollout settings `r`): its KV cache's tokens (set on `role`), and
    the problem when they hold less than one sequence."""
    avail = r.gpu_memory_utilization * gpu_memory
    weights = role.accelerator["weights (per TP rank)"]
    kv_tokens = (avail - weights - ACCELERATOR_RESERVE) / kv_bytes_per_token(arch, r.tensor_parallel_size)
    role.kv_tokens = max(0, int(kv_tokens))
    longest = r.max_model_len or 0
    if kv_tokens >= max(longest, 1):
        return []
    return [f"a {role.role}'s KV cache holds {max(0, int(kv_tokens))} tokens (weights {_gib(weights)} per TP rank in "
            f"{_gib(avail)}), less than one {longest}-token sequence: raise {tp_key} or "
            f"rollout.gpu_memory_utilization, or lower rollout.max_model_len"]


def teacher_memory(cfg: RunConfig, cluster: Cluster) -> tuple[RoleMemory, list[str]]:
    """distill.teacher: one teacher server's memory (its own architecture, accelerators and tensor
    parallelism) and what does not fit of it."""
    try:
        arch = architecture(cfg.distill.teacher)
    except FileNotFoundError as exc:
        raise PlanInputError(f"distill.teacher: {exc}") from None
    tcfg = teacher_run(cfg)
    on_acc = tcfg.rollout.num_gpus > 0 and cluster.gpus_per_node > 0
    role = server_memory(tcfg, arch, on_acc, cluster.gpu_memory_gb * GiB)
    role.role = "teacher server"
    known = cluster.gpu_memory_gb > 0
    return role, kv_cache_problems(tcfg.rollout, arch, role, cluster.gpu_memory_gb * GiB, "distill.tensor_parallel_size") if on_acc and known else []


def kv_bytes_per_token(arch: Architecture, tp: int) -> float:
    return 2 * arch.layers * arch.kv_dim * 2 / tp


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def plan(cfg: RunConfig, cluster: Cluster, model_path: str | None = None, with_servers: bool = True) -> Plan:
    """`model_path`: where the checkpoint is, when not cfg.model.path itself. A cluster whose
    accelerator memory is 0 (not known) is checked for host memory alone. with_servers=False:
    the trainer alone (`raytool sft`)."""
    arch = architecture(model_path or cfg.model.path)
    shortfall = accelerator_shortfall(cfg, cluster, with_servers)
    problems: list[str] = [shortfall] if shortfall else []  # first: without its accelerators no memory figure matters
    trainer_acc = cfg.trainer.num_gpus > 0 and cluster.gpus_per_node > 0
    server_acc = with_servers and cfg.rollout.num_gpus > 0 and cluster.gpus_per_node > 0
    gpu = cluster.gpu_memory_gb * GiB
    known = gpu > 0
    cfg, notes = resolve_auto(cfg, arch, trainer_acc, gpu, with_servers)
    t, r = cfg.trainer, cfg.rollout
    trainer = trainer_memory(cfg, arch, trainer_acc)
    server = server_memory(cfg, arch, server_acc, gpu)
    p = arch.params()
    if trainer_acc and known:
        budget = trainer_budget(cfg, gpu, with_servers)
        need = trainer.accelerator_total
        if need > budget:
            problems.append(f"a trainer worker needs {_gib(need)} of accelerator memory but has {_gib(budget)}: "
                            f"{_trainer_advice(cfg, trainer)}")
    if server_acc and known:
        problems += kv_cache_problems(r, arch, server, gpu, "rollout.tensor_parallel_size")
    teacher = teacher_memory(cfg, cluster) if with_servers and cfg.distill.has_servers else None
    if teacher is not None:
        problems += teacher[1]
    # host memory of the busiest node: its trainer workers (+ rank 0's loading or export), servers, teachers and object store
    trainers_per_node, servers_per_node = busiest_node(cfg, cluster, trainer_acc, server_acc, with_servers)
    teachers_per_node = teachers_on_busiest_node(cfg, cluster, trainers_per_node, servers_per_node, trainer_acc) if teacher is not None else 0
    loading = loading_peak(arch, t.load_in_4bit)
    export = export_peak(arch, engine_dtype(cfg.model.dtype, cfg.rollout.num_gpus > 0, engine="hf")[0])  # model.dtype, as the run resolves it
    store = object_store(cfg, cluster.host_memory_gb * GiB)
    host_need = trainers_per_node * trainer.host_total + max(loading, export) + servers_per_node * server.host_total + store
    host_need += teachers_per_node * teacher[0].host_total if teacher is not None else 0
    if host_need > cluster.host_memory_gb * GiB:
        advice = ("trainer.num_workers over more nodes, or trainer.cpu_offload=false" if t.cpu_offload
                  else "trainer.activation_checkpointing=true or a lower trainer.micro_batch_tokens" if not trainer_acc and not t.activation_checkpointing
                  else "fewer workers per node (more nodes) or a smaller model")
        peak = f"rank 0 loading the fp32 checkpoint {_gib(loading)}" if loading >= export else f"rank 0 writing the HF export {_gib(export)}"
        teachers = f"{teachers_per_node} teacher servers, " if teachers_per_node else ""
        problems.append(f"a node needs {_gib(host_need)} of host memory ({trainers_per_node} trainer workers, {peak}, {servers_per_node} "
                        f"rollout servers, {teachers}Ray's object store {_gib(store)}) but has {_gib(cluster.host_memory_gb * GiB)}: {advice}")
    if t.cpu_offload and trainer_acc and known:
        without = trainer_memory(msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(t, cpu_offload=False)), arch, True)
        if without.accelerator_total <= trainer_budget(cfg, gpu, with_servers):
            notes.append(f"trainer.cpu_offload: on, though a trainer worker fits its accelerator without it ({_gib(without.accelerator_total)}): "
                         "offload keeps parameters on the host for every step (measured 5.4x slower on an H100); set it false")
    try:
        check_heads(arch.heads, t.sequence_parallel_size)
    except ValueError as exc:
        problems.append(str(exc))
    roles = ([trainer, server] if with_servers else [trainer]) + ([teacher[0]] if teacher is not None else [])
    accelerators = {d.role: d.count * d.bundle[cfg.cluster.accelerator] for d in accelerator_demands(cfg, with_servers)}
    sync, sync_warning = sync_prediction(cfg, arch, cluster.link_gbit) if with_servers else ({}, "")
    return Plan(cfg.model.path, arch, p, arch.lora_params(t.lora_rank) if t.lora_rank else p, cluster, roles, problems, loading, notes,
                accelerators, cfg.cluster.accelerator, export, store, trainers_per_node, servers_per_node, sync, sync_warning)


def _trainer_advice(cfg: RunConfig, role: RoleMemory) -> str:
    """The config key that frees the most of the largest part."""
    t = cfg.trainer
    biggest = max(role.accelerator, key=role.accelerator.get)
    if biggest.startswith("activations") or biggest.startswith("LM head"):
        if not t.activation_checkpointing:
            return f"its largest part is {biggest} ({_gib(role.accelerator[biggest])}): set trainer.activation_checkpointing=true"
        return (f"its largest part is {biggest} ({_gib(role.accelerator[biggest])}): lower trainer.micro_batch_tokens or raise "
                f"trainer.sequence_parallel_size")
    if not t.cpu_offload:
        return f"its largest part is {biggest} ({_gib(role.accelerator[biggest])}): set trainer.cpu_offload=true or raise trainer.num_workers"
    return f"its largest part is {biggest} ({_gib(role.accelerator[biggest])}): raise trainer.num_workers"


def verdict(result: Plan) -> str:
    """One line: "fits" and the accelerators the roles take of the cluster's, or "does not fit"
    and the first problem."""
    if result.problems:
        more = len(result.problems) - 1
        return f"does not fit: {result.problems[0]}" + (f" (and {more} more problem{'s' if more > 1 else ''} below)" if more else "")
    c = result.cluster
    if not result.accelerators:
        return f"fits on {c.nodes} node(s) of {c.host_memory_gb:.1f} GiB host memory (no {result.accelerator}s asked)"
    roles = ", ".join(f"{n:g} for the {role}s" for role, n in result.accelerators.items())
    return (f"fits: {sum(result.accelerators.values()):g} of {c.nodes * c.gpus_per_node} {result.accelerator}s ({roles}) "
            f"on {c.nodes} node(s) x {c.gpus_per_node}")


def table(result: Plan) -> str:
    a, c = result.architecture, result.cluster
    lines = [verdict(result),
             f"model {result.model}: {result.params / 1e9:.3f}B parameters ({result.trained_params / 1e9:.3f}B trained), "
             f"{a.layers} layers, hidden {a.hidden}, {a.heads}/{a.kv_heads} heads, vocabulary {a.vocab} [{a.source}]",
             *([f"mixture of experts: {a.experts} experts of width {a.expert_intermediate} per layer, {a.experts_per_token} per token: "
                f"{a.active_params() / 1e9:.3f}B parameters active per token, experts {a.layers * a.expert_params(a.experts) / 1e9:.3f}B"]
               if a.moe else []),
             f"cluster: {c.nodes} node(s) x {c.gpus_per_node} accelerator(s) of {c.gpu_memory_gb:.0f} GiB, {c.host_memory_gb:.1f} GiB host memory each",
             *result.notes,
             ""]
    for role in result.roles:
        lines.append(f"{role.role} (x{role.count}):")
        for where, parts in (("accelerator", role.accelerator), ("host", role.host)):
            if parts:
                lines.append(f"  {where}: {_gib(sum(parts.values()))}")
                lines += [f"    {name:<64} {_gib(v):>11}" for name, v in parts.items()]
        if role.kv_tokens is not None:
            lines.append(f"  KV cache capacity: {role.kv_tokens} tokens")
        if role.role == "trainer worker":
            lines.append(f"  rank 0 while loading: + {_gib(result.loading)} host (it reads the checkpoint; any other ranks receive their shards)")
            lines.append(f"  rank 0 while exporting: + {_gib(result.export)} host (it writes the HF export shard by shard; the others hold one tensor)")
    if result.object_store:
        lines.append(f"busiest node: {result.trainers_per_node} trainer worker(s), {result.servers_per_node} rollout server(s), "
                     f"Ray's object store {_gib(result.object_store)} (the trajectories of the steps in flight)")
    if result.weight_sync:
        lines.append(f"weight sync to servers on other nodes at {c.link_gbit:g} Gbit/s (predicted): "
                     + ", ".join(f"{backend} {s:g}s" for backend, s in result.weight_sync.items()))
    if result.sync_warning:
        lines.append(f"warning: {result.sync_warning}")
    lines.append("")
    lines += [f"does not fit: {p}" for p in result.problems] or ["fits"]
    return "\n".join(lines)
