"""raytool.models.load_tokenizer: AutoTokenizer's tokenizer, loaded without torch where AutoTokenizer
would build the generic fast tokenizer (the agent workers' start), and AutoTokenizer's own answer
for every other checkpoint. The checkpoints are the built-in tiny model's tokenizer files with
their config naming each model type (transformers' own rules decide what AutoTokenizer builds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from raytool.models import GENERIC_TOKENIZER_MODEL_TYPES, load_tokenizer


def _checkpoint(tiny_model_path, directory, model_type: str | None = None, tokenizer_class: str | None = None) -> str:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(f"{tiny_model_path}/{name}", directory / name)
    for name, key, value in (("config.json", "model_type", model_type), ("tokenizer_config.json", "tokenizer_class", tokenizer_class)):
        if value is not None:
            (directory / name).write_text(json.dumps(json.loads((directory / name).read_text()) | {key: value}))
    return str(directory)


def _same_tokenizer(fast, auto) -> None:
    assert type(fast) is type(auto)
    assert fast.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()  # normalizer, pre-tokenizer, vocab, merges, post-processor
    assert fast.init_kwargs == auto.init_kwargs and fast.special_tokens_map == auto.special_tokens_map
    assert fast.added_tokens_decoder == auto.added_tokens_decoder and fast.chat_template == auto.chat_template
    chat = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "<code>print(6 * 7)</code> 42"}]
    assert fast.apply_chat_template(chat, tokenize=True, add_generation_prompt=True) == auto.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)


@pytest.mark.parametrize("model_type", GENERIC_TOKENIZER_MODEL_TYPES)
@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_the_generic_tokenizer_is_autotokenizers_own(tiny_model_path, tmp_path, model_type, tokenizer_class):
    from transformers import AutoTokenizer

    path = _checkpoint(tiny_model_path, tmp_path, model_type, tokenizer_class)
    _same_tokenizer(load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_the_generic_tokenizer_loads_without_torch(tiny_model_path):
    code = f"import sys; from raytool.models import load_tokenizer; load_tokenizer({tiny_model_path!r}); print(sorted(m for m in ('torch', 'transformers.models.auto') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("model_type", "tokenizer_class", "built"), [
    ("qwen2", "TokenizersBackend", "Qwen2Tokenizer"),  # transformers takes Qwen2's generic class for a mistake and builds its own
    ("llama", "Qwen2Tokenizer", "Qwen2Tokenizer"),  # the class the checkpoint names
])
def test_any_other_checkpoint_is_left_to_autotokenizer(tiny_model_path, tmp_path, model_type, tokenizer_class, built):
    from transformers import AutoTokenizer

    path = _checkpoint(tiny_model_path, tmp_path, model_type, tokenizer_class)
    assert type(load_tokenizer(path)).__name__ == built == type(AutoTokenizer.from_pretrained(path)).__name__
