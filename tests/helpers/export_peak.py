"""Export the trainer's model as an HF checkpoint on every rank and report what the export cost each
rank's host memory, for the streaming-export test.

    torchrun --nproc-per-node 4 tests/helpers/export_peak.py MODEL OUT SHARD_BYTES [key=value ...]

Each rank writes OUT.rankN.json: its resident memory just before the export and its peak during
it (bytes; the kernel's peak counter, VmHWM, is reset first through /proc/self/clear_refs), and the
size of the largest full tensor. Rank 0 also reports the export's files and whether every written
tensor equals the trainer's weight cast to the export dtype, bit for bit.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from proc_memory import memory
from raytool.config import load_config
from raytool.training import Trainer


def main(model: str, out: str, shard_bytes: int) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    cfg = load_config(None, ["trainer.compute_dtype=float32"] + sys.argv[4:])
    trainer = Trainer(cfg, model, rank=rank, world_size=world)
    shapes = {name: tuple(p.shape) for name, p in trainer.lm.named_parameters()}
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 4
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = memory("VmRSS")
    directory = trainer.export_hf(f"{out}.hf", max_shard_bytes=shard_bytes)
    peak = memory("VmHWM")
    report = {"rank": rank, "rss_before": before, "peak": peak, "largest_fp32_tensor": largest}
    weights = {name: w.to(torch.bfloat16) for name, w in trainer.named_weights()}  # a collective: every rank
    if rank == 0:
        from safetensors.torch import load_file

        files = sorted(p.name for p in os.scandir(directory) if p.name.endswith(".safetensors"))
        written = {}
        for name in files:
            written.update(load_file(os.path.join(directory, name)))
        report["files"] = files
        report["index"] = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
        report["config_dtype"] = json.load(open(os.path.join(directory, "config.json"))).get("dtype")
        report["names_equal"] = sorted(written) == sorted(weights)
        report["mismatched"] = [n for n, w in weights.items() if n not in written or not torch.equal(written[n], w)]
        report["dtypes"] = sorted({str(t.dtype) for t in written.values()})
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as rank0_load.py: no interpreter finalization under gloo's worker threads (pytorch/pytorch#179291)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
