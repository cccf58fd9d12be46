"""`raytool bench trainer` on a Qwen2.5-1.5B-shaped model (random weights, built on the GPU), one
fresh process for the build and for each variant, so that each variant has the whole GPU; each
variant's result is one JSON line appended to OUT (and flushed) as soon as it finishes.

    python tests/helpers/gpu_trainer_bench.py OUT.jsonl [VARIANT ...]

Variants: default (the device's auto settings), kernels (the same with trainer.kernels on: Liger-Kernel's
RMSNorm, SwiGLU and RoPE), mbt4096 (4,096-token micro-batches, the former
default), nockpt (16k micro-batches without activation checkpointing). A variant that fails
(e.g. out of memory) writes its error instead. Scripted for a lent device (scripts/device_checks.sh)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"default": [], "kernels": ["trainer.kernels=true"], "mbt4096": ["trainer.micro_batch_tokens=4096"],
            "nockpt": ["trainer.micro_batch_tokens=16384", "trainer.activation_checkpointing=false"]}


def build(directory: Path) -> None:
    """The planner's Qwen2.5-1.5B-Instruct architecture with random bf16 weights (the bench needs no tokenizer)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from raytool.planner import KNOWN

    a = KNOWN["Qwen2.5-1.5B-Instruct"]
    config = Qwen2Config(hidden_size=a["hidden"], intermediate_size=a["intermediate"], num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                         num_key_value_heads=a["kv_heads"], vocab_size=a["vocab"], tie_word_embeddings=a["tied"], max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def one(out: Path, name: str, model: str) -> None:
    """One variant's bench, its JSON line appended to `out`: the result, or the error (re-raised, so
    its traceback follows)."""
    from raytool.bench.trainer import bench
    from raytool.config import load_config

    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raytool.bench").setLevel(logging.INFO)
    try:
        table, result = bench(load_config(None, [f"model.path={model}", "trainer.num_gpus=1", *VARIANTS[name]]), repeats=2)
    except Exception as error:
        _append(out, {"variant": name, "overrides": VARIANTS[name], "error": f"{type(error).__name__}: {error}"[:2000]})
        raise
    print(table, flush=True)
    _append(out, {"variant": name, "overrides": VARIANTS[name], **result})


def _append(out: Path, record: dict) -> None:
    with out.open("a") as f:  # closed at once: the line is on disk if the run is cut off next
        f.write(json.dumps(record) + "\n")


def main() -> None:
    if sys.argv[1] == "--build":  # a child: the model, whose GPU memory goes with the process
        build(Path(sys.argv[2]))
        return
    if sys.argv[1] == "--one":  # a child: one variant
        one(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    out, names = Path(sys.argv[1]), sys.argv[2:] or ["default"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--build", tmp], check=True)
        for name in names:
            status = subprocess.run([sys.executable, __file__, "--one", str(out), name, tmp]).returncode
            print(f"trainer bench variant {name}: exit status {status}", flush=True)


if __name__ == "__main__":
    main()
