"""`raytool bench trainer` on a Qwen2.5-1.5B-shaped model (random weights, built on the GPU), one
fresh process per variant; each variant's result is one JSON line appended to OUT.

    python tests/helpers/gpu_trainer_bench.py OUT.jsonl [VARIANT ...]

Variants: default (the device's auto settings), mbt4096 (4,096-token micro-batches, the former
default), nockpt (16k micro-batches without activation checkpointing). A variant that fails
(e.g. out of memory) writes its error instead. Scripted for a lent device (scripts/device_checks.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"default": [], "mbt4096": ["trainer.micro_batch_tokens=4096"],
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


def one(model: str, overrides: list[str]) -> dict:
    from raytool.bench.trainer import bench
    from raytool.config import load_config

    table, result = bench(load_config(None, [f"model.path={model}", "trainer.num_gpus=1", *overrides]), repeats=2)
    print(table, flush=True)
    return result


def main() -> None:
    if sys.argv[1] == "--one":  # a child: one variant
        print(json.dumps(one(sys.argv[2], sys.argv[3:])))
        return
    out, names = Path(sys.argv[1]), sys.argv[2:] or ["default"]
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        for name in names:
            proc = subprocess.run([sys.executable, __file__, "--one", tmp, *VARIANTS[name]], capture_output=True, text=True)
            print(proc.stdout, proc.stderr[-3000:] if proc.returncode else "", flush=True)
            lines = proc.stdout.strip().splitlines()
            record = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr.strip().splitlines()[-1:]}
            with out.open("a") as f:
                f.write(json.dumps({"variant": name, "overrides": VARIANTS[name], **record}) + "\n")


if __name__ == "__main__":
    main()
