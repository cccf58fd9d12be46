"""The policy network the trainer optimizes: an HF causal LM whose forward returns the log-probs
(and entropy) of chosen tokens without ever holding a whole micro-batch's logits.

Why a wrapper: the LM head over a 152k vocabulary is the largest activation of a step (16k tokens
x 152k x 4 bytes = 10 GB in fp32). `PolicyModel.forward` runs the decoder to hidden states, then
the head over only the positions whose log-prob is needed (response tokens), in chunks that are
recomputed in the backward pass instead of stored. It is also the FSDP2 root, so calling it
gathers the root's parameters (embeddings, final norm, head) exactly as calling the HF model does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers' SDPA attention under a name with no mask function: for right-padded micro-batches,
# which never need a mask. Under "sdpa" every forward asks whether the position ids are packed
# ((diff != 1).all() read back from the device): a synchronisation per micro-batch on a GPU.
CAUSAL_SDPA = "raytool_causal_sdpa"


def causal_sdpa() -> str:
    """Register CAUSAL_SDPA (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def _chunk_logprobs(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, inv_temperature: float, with_entropy: bool, entropy_grad: bool):
    """log softmax(h W^T / T)[label] and, optionally, the entropy of that distribution, for [N, H] hidden states."""
    logits = (hidden @ weight.t()).float()
    if inv_temperature != 1.0:
        logits = logits * inv_temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


@functools.cache
def _compiled_chunk_logprobs():
    return torch.compile(_chunk_logprobs)


def liger_supported(model_type: str) -> bool:
    """Whether the installed Liger-Kernel has kernels for this transformers model type."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


class PolicyModel(nn.Module):
    """`lm` is an HF causal LM (optionally a peft model around one). With `sp_group` (Ulysses
    sequence parallelism, see raytool.training.sequence_parallel) its attention layers must be
    built with that module's ATTENTION implementation."""

    def __init__(self, lm: nn.Module, sp_group=None):
        super().__init__()
        self.lm = lm
        self.sp_group = sp_group
        self.chunk_logprobs = _chunk_logprobs

    def set_compiled(self, on: bool) -> None:
        """torch.compile (on) or not (off) each decoder layer's forward and the LM head's log-prob
        chunk. Compiling fuses the elementwise work around the matmuls (norms, rotary, SwiGLU,
        casts; the head's fp32 log-softmax and entropy) into few kernels: less memory traffic and
        fewer launches. FSDP2's hooks and activation checkpointing stay outside the compiled code;
        one graph serves every layer, and shapes turn dynamic after the first change. Switching
        back keeps the compiled code for next time."""
        trunk, _ = self._parts()
        for layer in trunk.layers:
            if not on:
                layer.__dict__.pop("forward", None)
                continue
            if "_compiled_forward" not in layer.__dict__:
                layer._compiled_forward = torch.compile(type(layer).forward.__get__(layer))
            layer.forward = layer._compiled_forward
        self.chunk_logprobs = _compiled_chunk_logprobs() if on else _chunk_logprobs

    def use_fused_kernels(self) -> None:
        """Liger-Kernel's fused Triton RMSNorm, SwiGLU MLP and rotary embedding in place of the
        model's own (trainer.kernels; CUDA GPUs), on this instance's modules; RoPE is patched in the
        model family's transformers module, so for this whole process. The LM head stays this
        module's chunked log-prob head: Liger's fused linear cross-entropy returns a loss, not the
        per-token log-probs and entropies the RL losses need. The model family is checked before the
        model loads (raytool.training.trainer.check_kernels)."""
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
        log.info("trainer.kernels: Liger-Kernel's RMSNorm, SwiGLU and RoPE in the %s model", base.config.model_type)

    def _parts(self):
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        return base.model, base.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        select: torch.Tensor,
        labels: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk_tokens: int = 1024,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        varlen: dict | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [R, T]; select [N] flat indices into R*T of the positions to score; labels [N]
        the token that follows each. Returns log-probs [N] and entropies [N] (or None).

        No attention mask: sequences are right-padded (a causal model never lets a real token see
        a later pad, and SDPA takes its causal fast path) or packed with position_ids restarting
        at 0 per sequence (a varlen kernel keeps them apart; `varlen`, Layout.varlen_kwargs(), gives
        a flash-attention kernel the sequences' bounds). Or rows of shared-prefix trees, whose
        `attention_mask` (bool [R, 1, T, T], batching.Layout) says which tokens each one sees."""
        trunk, head = self._parts()
        slicing = None
        if self.sp_group is not None:  # this rank runs its slice of the sequence; `select` becomes its own positions
            from raytool.training import sequence_parallel

            slicing = sequence_parallel.Slicing(input_ids, select, position_ids, self.lm.config.pad_token_id or 0, self.sp_group)
            sequence_parallel.set_micro_batch(self.sp_group, slicing.positions, packed=position_ids is not None)
            input_ids, position_ids, select, labels = slicing.input_ids, slicing.local_positions, slicing.local_select, labels[slicing.mine]
        flash = varlen if varlen and self.lm.config._attn_implementation.startswith("flash_attention") else {}
        if attention_mask is not None:
            flash = {"attention_mask": _as_attention_mask(attention_mask, self.lm.config._attn_implementation)}
        hidden = trunk(input_ids=input_ids, position_ids=position_ids, use_cache=False, **flash).last_hidden_state
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, select)
        inv_t = 1.0 / temperature if temperature > 0 else 1.0
        # One chunk: its logits are kept for backward. Several: each is recomputed in backward, so
        # only one chunk's fp32 logits exist at any time.
        recompute = torch.is_grad_enabled() and hidden.size(0) > chunk_tokens
        logps, entropies = [], []
        for start in range(0, hidden.size(0), chunk_tokens):
            args = (hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens], head.weight, inv_t, with_entropy, entropy_grad)
            lp, ent = checkpoint(self.chunk_logprobs, *args, use_reentrant=False) if recompute else self.chunk_logprobs(*args)
            logps.append(lp)
            if ent is not None:
                entropies.append(ent)
        logp = torch.cat(logps) if logps else hidden[:0, 0].float()  # empty, but on the graph: backward still runs the collectives
        entropy = (torch.cat(entropies) if entropies else torch.zeros_like(logp)) if with_entropy else None
        if slicing is not None:
            logp, entropy = slicing.gather(logp), (slicing.gather(entropy) if entropy is not None else None)
        return logp, entropy


def _as_attention_mask(allowed: torch.Tensor, implementation: str) -> torch.Tensor:
    """A boolean [R, 1, T, T] mask (True: attends) as the attention takes it: SDPA as it is,
    eager attention as a bias added to its scores (0 where it attends, the float32 minimum elsewhere)."""
    if implementation != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def load_lm(model_path: str, *, attn_implementation: str, activation_checkpointing: bool, lora_rank: int = 0,
            lora_alpha: int = 16, lora_target_modules: list[str] | None = None, empty: bool = False,
            quantized_4bit: tuple[torch.dtype, torch.device] | None = None) -> nn.Module:
    """The HF model in fp32 (the master weights), with LoRA adapters and activation checkpointing if
    asked. empty=True: the same model with its parameters on the meta device (nothing read, nothing
    allocated), for a rank that receives its shards from rank 0 (`load_sharded`).

    quantized_4bit=(compute dtype, device): QLoRA's base instead, loaded onto the device with every
    linear layer but the head in bitsandbytes NF4 (double-quantized, computing in that dtype) and
    the rest in that dtype; the LoRA adapters stay fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if quantized_4bit is not None:
        from transformers import BitsAndBytesConfig

        dtype, device = quantized_4bit
        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=nf4, device_map={"": str(device)},
                                                  attn_implementation=attn_implementation)
    elif empty:
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32,
                                                  attn_implementation=attn_implementation)
    else:
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attn_implementation)
    lm.config.use_cache = False
    if lora_rank:
        lm = with_lora(lm, lora_rank, lora_alpha, lora_target_modules)
    if activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank:
            lm.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need an input that requires grad
    lm.train()
    return lm


def load_sharded(model_path: str, compute_dtype: torch.dtype, cpu_offload: bool, device: torch.device, *, sp_group=None,
                 **lm_options) -> PolicyModel:
    """The policy, FSDP2-sharded over the current process group, read from disk by rank 0 alone.

    Rank 0 loads the checkpoint; every other rank builds the model on the meta device, so its host
    memory never holds more than its own shard and the one tensor being broadcast. After sharding,
    rank 0 broadcasts each full tensor and every rank keeps its shard of it. Buffers (rotary
    frequencies, which no checkpoint holds) are broadcast from rank 0 as well. One rank: loaded
    and sharded in place."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    broadcast = dist.get_world_size() > 1
    source = not broadcast or dist.get_rank() == 0
    policy = PolicyModel(load_lm(model_path, empty=not source, **lm_options), sp_group)
    full = policy.state_dict() if broadcast and source else {}  # holds the full tensors while sharding frees the module's
    shard(policy, compute_dtype, cpu_offload, device)
    if not broadcast:
        return policy
    if not source:  # allocate the shards (FSDP2's to_empty keeps tied weights tied) and the buffers
        policy.to_empty(device=torch.device("cpu") if cpu_offload else device)
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    for module in policy.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                if buffer.device != device:
                    buffer = module._buffers[name] = torch.empty_like(buffer, device=device)
                dist.broadcast(buffer, src=0)
    return policy


def with_lora(lm: nn.Module, rank: int, alpha: int, target_modules: list[str] | None) -> nn.Module:
    """`lm` with peft LoRA adapters (only they train); ["all-linear"] is peft's every linear layer but the head."""
    from peft import LoraConfig, get_peft_model

    targets = list(target_modules or ["all-linear"])
    return get_peft_model(lm, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear" if targets == ["all-linear"] else targets))


def shard(policy: PolicyModel, compute_dtype: torch.dtype, cpu_offload: bool, device: torch.device) -> None:
    """FSDP2 over the current process group: one unit per decoder layer, then the root.

    Parameters stay fp32 (master weights, optimizer state); forward and backward run in
    `compute_dtype`; gradients are reduced in fp32. The mesh is on `device`'s type: FSDP2's
    default mesh is on whatever accelerator is visible, which would move a CPU trainer's
    model onto a GPU it was not given."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
              "mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    trunk, _ = policy._parts()
    for layer in trunk.layers:
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)


def merged_named_weights(lm: nn.Module):
    """(HF name, tensor) of every weight the rollout engine needs; LoRA adapters are merged out of
    place (W + B A s), so the trainer's own fp32 weights never round-trip through a merge. A 4-bit
    base weight is dequantized first and merged in fp32."""
    if not hasattr(lm, "get_base_model"):
        yield from ((name, p.detach()) for name, p in lm.named_parameters())
        return
    from peft.tuners.lora import LoraLayer

    base = lm.get_base_model()
    deltas = {}
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            deltas[module_name] = module
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        w = _dequantized(p).float() if hasattr(p, "quant_state") else p.detach()
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            layer = deltas[owner.removesuffix(".base_layer")]
            if leaf == "weight":
                for adapter in layer.active_adapters:
                    w = w + layer.get_delta_weight(adapter).to(w.dtype)
            owner = owner.removesuffix(".base_layer")
        yield f"{owner}.{leaf}" if owner else leaf, w


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit parameter as the full tensor it stands for (in its quantization dtype)."""
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(p.data, p.quant_state)


def trainable_state(policy: torch.nn.Module, model_state: dict) -> dict:
    """The entries of `model_state` that are trainable parameters of `policy` (a QLoRA checkpoint's)."""
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    return {name: value for name, value in model_state.items() if name in trainable}


@contextlib.contextmanager
def single_process_quiet():
    """torch.distributed.checkpoint warns on every single-process save or load, which is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield
