"""HF checkpoints out of raytool: the trainer's streaming export (`Trainer.export_hf`) and
`raytool export` (a resumable, sharded checkpoint -> an HF checkpoint, in one process, any world
size the checkpoint was written with; LoRA merged).

Both write through `write_hf`: tensors arrive one at a time, in the model's dtype (model.dtype:
what the rollout engine loads, bf16 for the bf16 recipes), and go into safetensors shards of at
most `max_shard_bytes`, named and indexed as transformers names them (one `model.safetensors`, or
`model-0000K-of-0000N.safetensors` with `model.safetensors.index.json`). The writer holds at most
one open shard and the tensor being added; under FSDP2 only rank 0 keeps any gathered tensor (a
32B model gathered whole on each of a node's 8 ranks in fp32 was 131 GB a rank)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from raytool import storage
from raytool.errors import RaytoolError
from raytool.training.model import DTYPES, PolicyModel, load_lm, merged_named_weights, single_process_quiet, trainable_state, with_lora

log = logging.getLogger(__name__)

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size (save_pretrained's max_shard_size="5GB")
SAFETENSORS_NAME, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


class ShardWriter:
    """Writes (name, tensor) pairs into safetensors shards of at most `max_bytes` as they arrive
    (a tensor larger than that gets a shard of its own); `close()` names the shards and writes the
    index. What it holds at any time: the open shard's tensors and nothing else."""

    def __init__(self, directory: Path, max_bytes: int = MAX_SHARD_BYTES):
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.open: dict[str, torch.Tensor] = {}
        self.open_bytes = 0
        self.shards: list[list[str]] = []  # the names in each written shard, in order
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.open and self.open_bytes + size > self.max_bytes:
            self._flush()
        self.open[name] = tensor.detach().contiguous()
        self.open_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.open, self.directory / f".shard-{len(self.shards):05d}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.open))
        self.open, self.open_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names, write the index (when there are
        several); returns the weight files."""
        if self.open or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            os.replace(self.directory / ".shard-00000.tmp", self.directory / SAFETENSORS_NAME)
            return [self.directory / SAFETENSORS_NAME]
        files, weight_map = [], {}
        for k, names in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / f".shard-{k:05d}.tmp", self.directory / final)
            files.append(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
        return files


def export_dtype(model_dtype: str, source: str | Path) -> torch.dtype:
    """The dtype an export is written in: model.dtype (what the rollout engine loads); where that is
    still 'auto' (a Trainer built outside a run), the checkpoint's own dtype, fp32 if it names none."""
    if model_dtype != "auto":
        return DTYPES[model_dtype]
    config = json.loads((Path(source) / "config.json").read_text())
    named = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(named, torch.float32)


def is_fused_moe(lm: torch.nn.Module) -> bool:
    """Whether a model holds its experts fused (experts.gate_up_proj, 3-D), as transformers does in
    memory, where checkpoints hold them one by one (global shapes under FSDP2)."""
    return any(p.dim() == 3 and ".experts." in name for name, p in lm.named_parameters())


def write_hf(tensors: Iterable[tuple[str, torch.Tensor]], source: str | Path, directory: str | Path, dtype: torch.dtype, *,
             fused_moe: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """An HF checkpoint in `directory`: `tensors` (HF parameter names) cast to `dtype` on their
    device and moved to the host one at a time into bounded shards, next to `source`'s config
    (its dtype set to `dtype`), generation config, tokenizer and chat template."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("model*.safetensors"), directory / SAFETENSORS_INDEX]:
        stale.unlink(missing_ok=True)  # an earlier export into the same directory: its shards would mix with these
    if fused_moe:
        # transformers holds each layer's experts fused (experts.gate_up_proj), checkpoints one by one
        # (experts.N.gate_proj.weight), which vLLM loads; transformers' own save, on a shell of the
        # model without memory, writes that layout, and needs the whole state at once (rank 0 holds
        # the model in `dtype`: a mixture of experts' export is not streamed).
        from transformers import AutoConfig, AutoModelForCausalLM

        state = {name: w.to(dtype).cpu() for name, w in tensors}
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
        shell.save_pretrained(directory, state_dict=state, max_shard_size=max_shard_bytes)
        del state
    else:
        writer = ShardWriter(directory, max_shard_bytes)
        for name, w in tensors:
            writer.add(name, w.to(dtype).cpu())
        writer.close()
    for name in HF_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, directory / name)
    _set_config_dtype(directory / "config.json", dtype)
    return directory


def _set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """config.json names the dtype the weights are in (vLLM and transformers' dtype='auto' read it)."""
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    config.update(dict.fromkeys(keys, name))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_hf_to(location: str, tensors: Iterable[tuple[str, torch.Tensor]], source: str | Path, dtype: torch.dtype, **options) -> str:
    """write_hf to a local path or an fsspec URI (written to a local directory first, then uploaded
    over what the URI holds: export into a fresh location, as each step_N/hf is)."""
    if storage.is_local(location):
        write_hf(tensors, source, location, dtype, **options)
    else:
        with tempfile.TemporaryDirectory(prefix="raytool-hf-") as local:
            storage.put_dir(write_hf(tensors, source, Path(local), dtype, **options), location)
    return location


def export_checkpoint(ckpt: str | Path, out: str | Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM


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
    dtype = export_dtype(meta.get("model", {}).get("dtype", "auto"), hf_meta)
    out = write_hf(merged_named_weights(policy.lm), hf_meta, out, dtype, fused_moe=is_fused_moe(policy.lm))
    log.info("exported %s (%s) to %s", ckpt, str(dtype).removeprefix("torch."), out)
    return out


def _export_4bit(ckpt: Path, meta: dict, out: str | Path) -> Path:
    """A QLoRA checkpoint holds the adapters alone: its base is the run's model quantized again
    (in the dtype the run quantized it in), then dequantized and merged like the weights the
    rollout engine received."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


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
    dtype = export_dtype(meta.get("model", {}).get("dtype", "auto"), ckpt / "hf_meta")  # merged in fp32, written in model.dtype as Trainer.export_hf writes it
    out = write_hf(merged_named_weights(policy.lm), ckpt / "hf_meta", out, dtype)
    log.info("exported %s (4-bit base dequantized, adapters merged; %s) to %s", ckpt, str(dtype).removeprefix("torch."), out)
    return out
