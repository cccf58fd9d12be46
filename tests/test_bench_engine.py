"""`raytool bench engine`: its variants and one variant's measurement (the HF engine on the tiny
model here; the bench itself runs vLLM in a fresh process per variant)."""

from raytool.bench.engine import _variants, _worker


def test_variants_show_each_preload_alone_and_together():
    libs = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"]
    assert [(name, dtype, len(preload)) for name, dtype, preload in _variants(libs)] == [
        ("fp32", "float32", 0), ("bf16", "bfloat16", 0), ("fp16", "float16", 0), ("fp32+tcmalloc", "float32", 1), ("fp32+iomp", "float32", 1),
        ("fp32+tcmalloc+iomp", "float32", 2), ("bf16+tcmalloc+iomp", "bfloat16", 2)]
    assert [name for name, _, _ in _variants([])] == ["fp32", "bf16", "fp16"]


def test_one_variant_generates_the_default_workload(tiny_model_path):
    result = _worker({"model": tiny_model_path, "engine": "hf", "prompts": 2, "n": 2, "max_tokens": 8, "temperature": 1.0,
                      "eager": True, "dtype": "float32", "max_batch_size": 8})
    assert result["tokens"] == 2 * 2 * 8 and result["tokens_per_s"] > 0 and result["engine_start_s"] > 0
