"""Build the trainer on every rank and report what loading cost each rank, for the rank-0 loading test.

    torchrun --nproc-per-node 2 tests/helpers/rank0_load.py MODEL OUT [key=value ...]

Each rank writes OUT.rankN.json: its resident memory before building the trainer (with the
model's code imported) and its peak after (bytes). Rank 0 also compares every weight the trainer holds (gathered from the shards)
with the checkpoint as transformers loads it in fp32, bit for bit (LoRA merged: its B starts at
zero), and the KL reference's too.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from proc_memory import memory
from raytool.config import load_config
from raytool.training import Trainer
from raytool.training.model import load_lm


def main(model: str, out: str) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    cfg = load_config(None, ["trainer.compute_dtype=float32"] + sys.argv[3:])
    load_lm(model, attn_implementation=cfg.model.attn_implementation, activation_checkpointing=False, empty=True)  # imports the model's code
    before = memory("VmRSS")
    trainer = Trainer(cfg, model, rank=rank, world_size=world)
    peak = memory("VmHWM")
    weights = dict(trainer.named_weights())  # a collective: every rank
    reference = trainer._reference()  # with LoRA: the policy with its adapters off
    reference_weights = {} if cfg.trainer.lora_rank else {name: p.full_tensor() for name, p in reference.lm.named_parameters()}
    report = {"rank": rank, "rss_before": before, "peak": peak, "buffers_equal": True}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        expected = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        params = dict(expected.named_parameters())
        report["mismatched"] = [n for n, w in weights.items() if not torch.equal(w, params[n].detach())]
        report["reference_mismatched"] = [n for n, w in reference_weights.items() if not torch.equal(w, params[n].detach())]
        report["checked"] = len(weights)
    # rotary frequencies are buffers no checkpoint holds: every rank must have rank 0's
    for name, b in trainer.policy.named_buffers():
        copy = b.clone()
        dist.broadcast(copy, src=0)
        report["buffers_equal"] &= bool(torch.equal(copy, b))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    # Leave without the interpreter's finalization: now and then (about 1 run in 25 here) a gloo
    # worker thread still holding a finished collective's tensors aborted it with "terminate called
    # without an active exception" (SIGABRT) after everything was written (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
