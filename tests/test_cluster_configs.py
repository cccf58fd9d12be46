"""The `ray up` YAMLs, the job runtime_env and the Docker images, checked without a cluster: Ray's own
config pipeline accepts each YAML, the commands in them parse as the `ray start` they claim to be,
and the images the YAMLs name are the ones docker/ builds. tests/integration/test_ray_up.py walks
gpu_nodes.yaml for real."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

# importing Ray's CLI module warns about pydantic APIs it uses; not this test's business
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "cluster_configs"
CLUSTER_YAMLS = ["gpu_nodes.yaml", "ascend_npu.yaml", "aws.yaml"]
DOCKERFILES = [REPO / "Dockerfile", REPO / "docker" / "gpu.Dockerfile", REPO / "docker" / "ascend.Dockerfile"]


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def bootstrap_like_ray_up(config: dict) -> dict:
    """What `ray up` (ray 2.60: commands.create_or_update_cluster -> _bootstrap_config) does with a
    cluster YAML before it touches a machine: prepare_config (defaults, merged setup commands, the
    docker checks, per-node-type worker bounds), the provider's resource fill-out, Ray's JSON schema
    and consistency checks (util.validate_config), the provider's bootstrap. For the local provider
    that is `_bootstrap_config` itself. AWS's fill-out and bootstrap call EC2 (boto3, credentials),
    so for it: prepare_config + validate_config, with the node types' resources written out in the
    YAML (what validate_config needs when the fill-out cannot run)."""
    from ray.autoscaler._private.commands import _bootstrap_config
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = copy.deepcopy(config)
    if config["provider"]["type"] == "local":
        return _bootstrap_config(config, no_config_cache=True)
    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def ray_start_invocations(commands: list[str]) -> list[tuple[dict, list[str]]]:
    """Each `ray start ...` in a list of shell commands: (its VAR=value prefix, its arguments)."""
    found = []
    for command in commands:
        for part in re.split(r";|&&", command):
            words = shlex.split(part)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words[:2] == ["ray", "start"]:
                found.append((env, words[2:]))
    return found


def parse_ray_start(args: list[str]) -> dict:
    """The options `ray start` would run with (Ray's own click command parses them; a typo fails)."""
    from ray.scripts.scripts import start

    return start.make_context("ray start", list(args)).params


@pytest.mark.parametrize("name", CLUSTER_YAMLS)
def test_ray_up_accepts_each_cluster_yaml(name):
    config = bootstrap_like_ray_up(load(name))
    assert config["head_node_type"] in config["available_node_types"]
    assert config["cluster_synced_files"] == [] and "auth" in config  # filled in by Ray's defaults


def test_ray_up_rejects_a_misspelt_key():
    """The check above can fail: a key Ray's schema does not know (docker.run_option) is refused."""
    import jsonschema

    config = load("gpu_nodes.yaml")
    config["docker"]["run_option"] = config["docker"].pop("run_options")
    with pytest.raises(jsonschema.ValidationError, match="run_option"):
        bootstrap_like_ray_up(config)


@pytest.mark.parametrize("name", CLUSTER_YAMLS)
def test_every_node_starts_ray_with_token_auth_and_valid_flags(name):
    config = load(name)
    head = ray_start_invocations(config["head_start_ray_commands"])
    workers = ray_start_invocations(config["worker_start_ray_commands"])
    assert len(head) == 1 and len(workers) == 1
    for env, args in head + workers:
        assert env.get("RAY_AUTH_MODE") == "token", args
        parse_ray_start(args)
    head_opts = parse_ray_start(head[0][1])
    assert head_opts["head"] and head_opts["dashboard_host"] == "0.0.0.0"
    # the head's autoscaler starts the workers; it reads the config `ray up` copies there
    assert head_opts["autoscaling_config"] == "~/ray_bootstrap_config.yaml"
    assert parse_ray_start(workers[0][1])["address"] == "$RAY_HEAD_IP:6379"
    # every node gets the token `ray job submit` presents
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"


@pytest.mark.parametrize("name", ["gpu_nodes.yaml", "ascend_npu.yaml"])
def test_setup_puts_the_environment_on_the_login_path_once(name, tmp_path):
    """`ray down` runs `ray stop` through `bash --login`; the setup line makes ~/.bashrc (which
    Ray's login shells source) put /opt/raytool/.venv/bin first, and a second `ray up` adds nothing."""
    (tmp_path / ".bashrc").write_text("# existing\n")
    for _ in range(2):
        for command in load(name)["setup_commands"]:
            subprocess.run(["bash", "-c", command], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    bashrc = (tmp_path / ".bashrc").read_text()
    assert bashrc.startswith("# existing\n") and bashrc.count("/opt/raytool/.venv/bin") == 1
    path = subprocess.run(["bash", "-c", f"source {tmp_path}/.bashrc; echo $PATH"], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True).stdout.strip()
    assert path.split(":")[0] == "/opt/raytool/.venv/bin"


def test_gpu_nodes_containers_get_the_gpus_shared_memory_and_host_network():
    from ray.autoscaler._private.docker import docker_start_cmds

    docker = load("gpu_nodes.yaml")["docker"]
    run = shlex.split(docker_start_cmds("ubuntu", docker["image"], {}, docker["container_name"], docker["run_options"],
                                        "raytool-gpu", "/home/raytool", "docker"))
    assert run[run.index("--gpus") + 1] == "all"
    assert any(re.fullmatch(r"--shm-size=\d+g", word) for word in run)
    assert run.count("--net=host") == 1 and run[-2:] == ["raytool:gpu", "bash"]  # Ray adds the host network itself


def test_ascend_nodes_get_eight_npus_their_driver_and_hccl_settings():
    """The container gets /dev/davinci0..7, the management devices and the host's driver files, and
    Ray on every node declares as many NPUs as the container has devices."""
    from ray.autoscaler._private.docker import docker_start_cmds

    config = load("ascend_npu.yaml")
    docker = config["docker"]
    run = shlex.split(docker_start_cmds("root", docker["image"], {}, docker["container_name"], docker["run_options"],
                                        "raytool-ascend", "/home/raytool", "docker"))
    devices = {word.split("=", 1)[1] for word in run if word.startswith("--device=")}
    npus = {d for d in devices if re.fullmatch(r"/dev/davinci\d+", d)}
    assert npus == {f"/dev/davinci{i}" for i in range(8)}
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    mounts = {run[i + 1].split(":")[0] for i, word in enumerate(run) if word == "-v"}
    assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info"} <= mounts
    env = dict(run[i + 1].split("=", 1) for i, word in enumerate(run) if word == "-e")
    assert int(env["HCCL_CONNECT_TIMEOUT"]) >= 120 and int(env["HCCL_BUFFSIZE"]) > 0 and env["HCCL_SOCKET_IFNAME"]
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        ((_, args),) = ray_start_invocations(commands)
        assert json.loads(parse_ray_start(args)["resources"]) == {"NPU": len(npus)}


def test_aws_has_a_cpu_head_gpu_workers_and_sandbox_nodes_raytool_pools_can_ask_for():
    from actors.common import actor_options
    from raytool.config import load_config

    types = bootstrap_like_ray_up(load("aws.yaml"))["available_node_types"]
    head = types[load("aws.yaml")["head_node_type"]]["resources"]
    assert head["CPU"] > 0 and "GPU" not in head
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0 and t["max_workers"] > 0]
    assert gpu_types
    # GPU containers get the GPUs; CPU nodes would refuse `--gpus all`
    for t in types.values():
        gets_gpus = "--gpus all" in t.get("docker", {}).get("worker_run_options", [])
        assert gets_gpus == (t in gpu_types)
    (sandbox,) = [t for t in types.values() if t["resources"].get("sandbox", 0) > 0]
    assert "GPU" not in sandbox["resources"] and sandbox["max_workers"] > 0
    # what a run config's sandbox.pool_resources makes each SandboxPool actor ask Ray for
    pools = load_config(None, ["sandbox.pool_resources={sandbox: 1}"]).sandbox.pool_resources
    assert actor_options(0.0, resources=dict(pools))["resources"] == {"sandbox": 1.0}
    assert set(pools) <= set(sandbox["resources"])


def test_runtime_env_is_what_ray_job_submit_accepts_and_ships_no_virtualenv():
    """`ray job submit --runtime-env` parses the file (parse_runtime_env_args) and the SDK builds a
    RuntimeEnv from it; the working_dir upload leaves .venv, .git and runs out by `excludes` alone."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    env = parse_runtime_env_args(runtime_env=str(CONFIGS / "runtime_env.yaml"))
    assert RuntimeEnv(**env)["env_vars"]["HF_HUB_OFFLINE"] == "1"
    assert env["working_dir"] == "."
    shipped = []
    _dir_travel(REPO, [_get_excludes(REPO, env["excludes"])], lambda p: shipped.append(p.relative_to(REPO).as_posix()),
                include_gitignore=False)
    assert "raytool/cli.py" in shipped and "examples/tiny_cpu.yaml" in shipped
    assert not [p for p in shipped if p.split("/")[0] in {".venv", ".git", "runs"} or "__pycache__" in p]


# --- Docker images (no Docker daemon here: the Dockerfiles are read, not built) ---

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def built_tag(path: Path) -> str:
    """The image name a Dockerfile's header tells you to build it as (`docker build ... -t NAME`)."""
    tags = set(re.findall(r"^#.*docker build .*-t (\S+)", path.read_text(), re.M))
    assert len(tags) == 1, f"{path}: expected one `docker build ... -t NAME` in its header comment, found {tags}"
    return tags.pop()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_its_base_installs_raytool_and_runs_as_a_user(path):
    instructions = dockerfile_instructions(path)
    args = dict(re.match(r"(\w+)(?:=(\S*))?", a).groups() for op, a in instructions if op == "ARG")
    bases = [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1)) or "", a.split()[0]) for op, a in instructions if op == "FROM"]
    for base in bases:
        name, _, tag = base.rpartition(":") if ":" in base.split("/")[-1] else (base, "", "")
        assert tag and tag != "latest", f"{path.name}: FROM {base} is not pinned to a release tag"
    for op, command in instructions:
        if op == "RUN":  # what `docker build` hands to the shell parses as shell
            checked = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
            assert checked.returncode == 0, f"{path.name}: RUN {command[:80]}...: {checked.stderr}"
    runs = " ".join(a for op, a in instructions if op == "RUN")
    assert re.search(r"pip install .*(\s\.\s|\s\.$|\s\"\.\[[a-z,]+\]\")|scripts/setup\.sh", runs), f"{path.name}: no RUN installs raytool"
    assert re.search(r"(import|from) raytool", runs), f"{path.name}: the build never imports raytool"
    users = [a.strip() for op, a in instructions if op == "USER"]
    assert users and users[-1] not in {"root", "0", "0:0"}, f"{path.name}: the image runs as root"
    assert re.search(rf"useradd .*\b{re.escape(users[-1])}\b", runs)


def test_gpu_and_ascend_images_pin_the_ray_this_client_runs():
    """`ray up` / `ray job submit` from here and the cluster's nodes must agree on Ray's version."""
    import ray

    for path in DOCKERFILES[1:]:
        (pinned,) = re.findall(r"^ARG RAY_VERSION=(\S+)", path.read_text(), re.M)
        assert pinned == ray.__version__, f"{path}: RAY_VERSION={pinned}, but this environment runs ray {ray.__version__}"


@pytest.mark.parametrize("name", CLUSTER_YAMLS)
def test_cluster_yaml_runs_one_image_that_docker_builds(name):
    """Each image a cluster YAML names (after an optional registry prefix) is the tag one of the
    Dockerfiles documents, and one cluster runs one image: Ray needs one Ray and Python version on
    every node."""
    tags = {built_tag(path): path for path in DOCKERFILES}
    config = load(name)
    docker = config["docker"]
    images = {docker[k] for k in ("image", "head_image", "worker_image") if k in docker}
    images |= {t["docker"]["worker_image"] for t in config.get("available_node_types", {}).values() if "worker_image" in t.get("docker", {})}
    built = {image.rsplit("/", 1)[-1] for image in images}
    assert built <= set(tags), f"{name} names {built - set(tags)}, which no Dockerfile builds ({sorted(tags)})"
    assert len(built) == 1
