"""`raytool export`: a resumable (sharded) checkpoint -> an HF checkpoint that vLLM and
transformers load. One process, any world size the checkpoint was written with; LoRA merged."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import torch

from raytool import storage
from raytool.errors import RaytoolError
from raytool.training.model import PolicyModel, merged_named_weights, with_lora

log = logging.getLogger(__name__)


def export_checkpoint(ckpt: str | Path, out: str | Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from raytool.training.trainer import single_process_quiet, write_hf

    if not storage.is_local(ckpt):  # an fsspec URI: read a local copy (one process reads every shard anyway)
        with tempfile.TemporaryDirectory(prefix="raytool-ckpt-") as local:
            return export_checkpoint(storage.get_dir(ckpt, local), out)
    ckpt = Path(ckpt)
    meta_file, hf_meta = ckpt / "trainer_meta.json", ckpt / "hf_meta"
    if not meta_file.is_file() or not (ckpt / "dcp").is_dir():
        raise RaytoolError(f"--ckpt {ckpt}: not a raytool checkpoint (expected trainer_meta.json and dcp/ in it: a runs/<run>/checkpoints/step_N directory)")
    meta = json.loads(meta_file.read_text())
    # Parameters are allocated empty and filled from the checkpoint (no random init of a big model).
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_meta), dtype=torch.float32)
        if meta["lora"]:
            t = meta["trainer"]
            lm = with_lora(lm, t["lora_rank"], t["lora_alpha"], t["lora_target_modules"])
    policy = PolicyModel(lm).to_empty(device="cpu")
    (lm.get_base_model() if meta["lora"] else lm).tie_weights()  # to_empty gives tied parameters storage of their own
    state = {"model": get_model_state_dict(policy)}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)  # one process reads every shard
    set_model_state_dict(policy, state["model"])
    weights = {name: w.contiguous() for name, w in merged_named_weights(policy.lm)}
    out = write_hf(weights, hf_meta, out)
    log.info("exported %d tensors from %s to %s", len(weights), ckpt, out)
    return out
