"""Start failures of a rollout engine read as one line naming the server, the model and the cause."""

import json

import pytest

from raytool.errors import describe_engine_failure, one_line, preflight_engine


def test_a_missing_checkpoint_is_named_before_any_engine_starts(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        preflight_engine(str(tmp_path / "nope"), "vllm")
    line = describe_engine_failure("rollout-1", str(tmp_path / "nope"), "vllm", err.value)
    assert line.startswith("rollout server rollout-1 (vllm, model ") and "bad model path" in line and "\n" not in line


def test_a_head_size_without_a_cpu_kernel_is_reported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="head size 16 has no vLLM CPU kernel") as err:
        preflight_engine(str(tmp_path), "vllm")
    assert "unsupported head size" in describe_engine_failure("rollout-0", str(tmp_path), "vllm", err.value)
    preflight_engine(str(tmp_path), "hf")  # the HF engine runs any head size


def test_out_of_memory_and_multi_line_causes_stay_on_one_line():
    exc = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nGPU 0 has 1.2 GiB free")
    line = describe_engine_failure("rollout-0", "/m", "vllm", exc)
    assert "out of memory" in line and "\n" not in line and "1.2 GiB free" in line
    assert len(one_line(RuntimeError("x" * 5000))) < 450
