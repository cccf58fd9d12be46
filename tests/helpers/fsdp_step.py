"""One RL step of the trainer on a fixed batch, for the FSDP equivalence test.

    torchrun --nproc-per-node 2 tests/helpers/fsdp_step.py MODEL OUT   # 2 ranks, FSDP2 over gloo
    python tests/helpers/fsdp_step.py MODEL OUT                        # one process

Writes OUT (torch.save): the full gradient of every parameter as the optimizer sees it, the
step's metrics, the whole batch's log-probs before it and the weights after it; and a resumable checkpoint in OUT.ckpt. Each rank trains on its share of the batch, as TrainerGroup hands it out.
"""

import os
import sys

import torch
import torch.distributed as dist

from raytool.config import load_config
from raytool.training import Trainer
from raytool.training.trainer import _Seq
from raytool.training.batching import split_across_ranks
from raytool.types import TrainBatch, TrainSequence, Trajectory


def batch() -> list[list[Trajectory]]:
    def traj(uid, group, prompt, response, reward):
        return Trajectory(uid=uid, group_id=group, prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                          rollout_logprobs=[0.0] * len(response), messages=[], ground_truth="", reward=reward)

    return [
        [traj("a", "g0", [1, 2, 3], [5, 6, 7], 1.0), traj("b", "g0", [1, 2, 3], [8, 9], 0.0), traj("c", "g0", [1, 2, 3], [8, 9, 10, 11], 0.5)],
        [traj("d", "g1", [1, 4], [5, 6, 7, 8, 9], 0.0), traj("e", "g1", [1, 4], [10, 11], 1.0)],
    ]


def main(model: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    cfg = load_config(None, ["trainer.lr=1e-2", "trainer.micro_batch_tokens=12", "algorithm.loss_agg=seq-mean-token-mean"] + sys.argv[3:])
    trainer = Trainer(cfg, model, rank=rank, world_size=world)
    groups = batch()
    rewards = [t.reward for g in groups for t in g]
    group_ids = [i for i, g in enumerate(groups) for _ in g]
    offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
    share = split_across_ranks([[len(t.response_ids) + 1 for t in g] for g in groups], world, cfg.trainer.sequence_parallel_size)[rank]
    own = [groups[g][i] for g, positions in sorted(share.items()) for i in positions]
    index = [offsets[g] + i for g, positions in sorted(share.items()) for i in positions]
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        for (name, _), p in zip(trainer.lm.named_parameters(), trainer.lm.parameters()):
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    everything = [t for g in groups for t in g]  # the log-probs of the whole batch, before the step (a collective: every rank)
    with torch.no_grad():
        logprobs, _ = trainer._logprobs(trainer.policy, [_Seq(ids=t.prompt_ids + t.response_ids, mask=[0] * (len(t.prompt_ids) - 1) + t.response_mask)
                                                         for t in everything], temperature=1.0)
    metrics = trainer.rl_step(TrainBatch([TrainSequence.of(t) for t in own], index, rewards, group_ids, [True] * len(rewards)))
    weights = {name: w.clone() for name, w in trainer.named_weights()}  # a collective: every rank
    trainer.save_checkpoint(out + ".ckpt")
    if rank == 0:
        torch.save({"grads": grads, "metrics": metrics, "weights": weights, "logprobs": logprobs}, out)
    if world > 1:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: now and then (about 1 run in 25 here) a gloo
    # worker thread still holding a finished collective's tensors aborted it with "terminate called
    # without an active exception" (SIGABRT) after everything was written (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
