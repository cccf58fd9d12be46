"""trainer.kernels (Liger-Kernel) in a process of its own: the patch replaces transformers' rotary
embedding module-wide, so no other test may share the process.

    python tests/helpers/fused_kernels.py modules MODEL      # which modules the kernels replaced (any device)
    python tests/helpers/fused_kernels.py step MODEL DTYPE   # CUDA: RL steps with the kernels off, then on

Prints one JSON object as its last line."""

from __future__ import annotations

import json
import sys

import torch

from raytool.types import TrainBatch


def modules(model_path: str) -> dict:
    """PolicyModel.use_fused_kernels on a plain and on a LoRA-wrapped model, on the CPU: no kernel runs."""
    from transformers.models.llama import modeling_llama

    from raytool.training.model import PolicyModel, load_lm

    out = {}
    for name, lora_rank in (("plain", 0), ("lora", 4)):
        policy = PolicyModel(load_lm(model_path, attn_implementation="sdpa", activation_checkpointing=False, lora_rank=lora_rank))
        policy.use_fused_kernels()
        trunk, _ = policy._parts()
        layer = trunk.layers[0]
        out[name] = {"mlp": layer.mlp.forward.__func__.__qualname__, "input_layernorm": layer.input_layernorm.forward.__func__.__qualname__,
                     "final_norm": trunk.norm.forward.__func__.__qualname__, "layers": len(trunk.layers),
                     "patched_layers": sum(layer.mlp.forward.__func__.__qualname__.startswith("Liger") for layer in trunk.layers)}
    out["rope"] = modeling_llama.apply_rotary_pos_emb.__module__
    return out


def step(model_path: str, dtype: str) -> dict:
    """Two RL steps (same batch, same seed) with trainer.kernels off and then on: each step's loss,
    entropy and gradient norm, the batch's log-probs and entropies before any update, and every
    parameter's gradient at the first step compared (cosine, norm ratio)."""
    from raytool.config import load_config
    from raytool.training import Trainer
    from raytool.types import Trajectory

    batch = [Trajectory(uid=str(i), group_id=str(i // 2), prompt_ids=[1, 2, 3 + i], response_ids=list(range(5 + 20 * i, 17 + 23 * i)),
                        response_mask=[1] * (12 + 3 * i), rollout_logprobs=[-1.0] * (12 + 3 * i), messages=[], ground_truth="",
                        reward=float(i % 2)) for i in range(4)]
    out, grads = {}, {}
    for kernels in ("false", "true"):  # off first: the kernels' RoPE patch is process-wide
        cfg = load_config(None, ["trainer.num_gpus=1", f"trainer.kernels={kernels}", f"trainer.compute_dtype={dtype}", "trainer.compile=false",
                                 "trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=8", "trainer.lr=1e-3"])
        trainer = Trainer(cfg, model_path, device="cuda")
        logprobs, entropies = [], []
        with torch.no_grad():
            for t in batch:
                ids = torch.tensor([t.prompt_ids + t.response_ids], device="cuda")
                select = torch.arange(len(t.prompt_ids) - 1, ids.size(1) - 1, device="cuda")
                lp, ent = trainer.policy(ids, select, ids[0, len(t.prompt_ids):], with_entropy=True)
                logprobs += lp.float().tolist()
                entropies += ent.float().tolist()
        grads[kernels] = _grads_at_first_step(trainer)
        metrics = [trainer.rl_step(TrainBatch.whole(batch)) for _ in range(2)]
        out[kernels] = {"logprobs": logprobs, "entropies": entropies,
                        "metrics": [{k: m[k] for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm")} for m in metrics]}
        del trainer
        torch.cuda.empty_cache()
    # every parameter's gradient at the first step: its cosine to the eager one, and its norm's ratio
    out["grads"] = {name: [torch.nn.functional.cosine_similarity(g.flatten(), grads["true"][name].flatten(), dim=0).item(),
                           (grads["true"][name].norm() / g.norm()).item() if g.norm() > 0 else 1.0] for name, g in grads["false"].items()}
    return out


def _grads_at_first_step(trainer) -> dict:
    """Every parameter's gradient as the first optimizer step sees it (whole, in fp32 on the CPU)."""
    grads: dict = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        if not grads:
            for name, p in trainer.lm.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[name] = g.detach().float().cpu()
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return grads


if __name__ == "__main__":
    mode, model = sys.argv[1], sys.argv[2]
    print(json.dumps(modules(model) if mode == "modules" else step(model, sys.argv[3])))
