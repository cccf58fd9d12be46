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
from raytool.training.model import DTYPES, PolicyModel, load_lm, merged_named_weights, with_lora

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
    if meta["trainer"].get("load_in_4bit"):
        return _export_4bit(ckpt, meta, out)
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


def _export_4bit(ckpt: Path, meta: dict, out: str | Path) -> Path:
    """A QLoRA checkpoint holds the adapters alone: its base is the run's model quantized again
    (in the dtype the run quantized it in), then dequantized and merged like the weights the
    rollout engine received."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from raytool.training.trainer import single_process_quiet, trainable_state, write_hf

    t, base = meta["trainer"], meta["model_path"]
    if not (Path(base) / "config.json").is_file():
        raise RaytoolError(f"--ckpt {ckpt}: a trainer.load_in_4bit checkpoint holds the LoRA adapters only; its base model {base} "
                           "(trainer_meta.json's model_path) must be readable here")
    dtype = torch.bfloat16 if t["compute_dtype"] == "auto" else DTYPES[t["compute_dtype"]]  # auto is bf16 on the GPUs 4-bit runs on
    lm = load_lm(base, attn_implementation="sdpa", activation_checkpointing=False, lora_rank=t["lora_rank"], lora_alpha=t["lora_alpha"],
                 lora_target_modules=t["lora_target_modules"], quantized_4bit=(dtype, torch.device("cpu")))
    policy = PolicyModel(lm)
    state = {"model": trainable_state(policy, get_model_state_dict(policy))}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    set_model_state_dict(policy, state["model"], options=StateDictOptions(strict=False))
    weights = {name: w.contiguous() for name, w in merged_named_weights(policy.lm)}  # fp32, as Trainer.export_hf writes them
    out = write_hf(weights, ckpt / "hf_meta", out)
    log.info("exported %d tensors (4-bit base dequantized, adapters merged) from %s to %s", len(weights), ckpt, out)
    return out
