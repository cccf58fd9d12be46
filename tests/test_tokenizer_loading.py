"""raytool.models.load_tokenizer: AutoTokenizer's tokenizer, loaded without torch where the
checkpoint asks for the generic fast tokenizer (the agent workers' start), and AutoTokenizer's own
answer for every other class."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from raytool.models import load_tokenizer


def test_the_generic_tokenizer_is_autotokenizers_own(tiny_model_path):
    from transformers import AutoTokenizer

    fast, auto = load_tokenizer(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)
    assert type(fast) is type(auto)
    assert fast.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()  # normalizer, pre-tokenizer, vocab, merges, post-processor
    assert fast.init_kwargs == auto.init_kwargs and fast.special_tokens_map == auto.special_tokens_map
    assert fast.added_tokens_decoder == auto.added_tokens_decoder and fast.chat_template == auto.chat_template
    chat = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "<code>print(6 * 7)</code> 42"}]
    assert fast.apply_chat_template(chat, tokenize=True, add_generation_prompt=True) == auto.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)


def test_the_generic_tokenizer_loads_without_torch(tiny_model_path):
    code = f"import sys; from raytool.models import load_tokenizer; load_tokenizer({tiny_model_path!r}); print(sorted(m for m in ('torch', 'transformers.models.auto') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_another_class_is_left_to_autotokenizer(tiny_model_path, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_path}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(str(tmp_path))).__name__ == "Qwen2Tokenizer"
