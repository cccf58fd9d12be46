"""One RL step of the trainer on a batch that fills one micro-batch, and the process's peak memory.

    python tests/helpers/trainer_peak.py MODEL OUT [key=value ...]

Writes OUT (JSON): the peak resident memory of this process (bytes, VmHWM), for the planner's test. The
batch is trainer.micro_batch_tokens tokens: sequences of 512 tokens (a 16-token prompt and a
496-token response, every response token trained), rewards alternating so every advantage is non-zero.
"""

import json
import sys

import torch

from proc_memory import memory
from raytool.config import load_config
from raytool.models import resolve_model
from raytool.training import Trainer
from raytool.types import TrainBatch, Trajectory


def main(model: str, out: str) -> None:
    cfg = load_config(None, sys.argv[3:])
    trainer = Trainer(cfg, resolve_model(model))
    g = torch.Generator().manual_seed(0)
    vocab = trainer.lm.config.vocab_size
    batch = []
    for k in range(max(1, cfg.trainer.micro_batch_tokens // 512)):
        ids = torch.randint(3, vocab, (512,), generator=g).tolist()
        batch.append(Trajectory(uid=str(k), group_id="g", prompt_ids=ids[:16], response_ids=ids[16:], response_mask=[1] * 496,
                                rollout_logprobs=[0.0] * 496, messages=[], ground_truth="", reward=float(k % 2)))
    trainer.rl_step(TrainBatch.whole(batch))
    with open(out, "w") as f:
        json.dump({"peak": memory("VmHWM")}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
