"""The `ray up` YAMLs, the job runtime_env and the Docker images, checked without a cluster: Ray's own
config pipeline accepts each YAML, the commands in them parse as the `ray start` they claim to be,
each recipe's cluster file gives its nodes what the recipe needs (accelerators, shared mounts, NIC
settings, the code sandbox its tool file calls), and the images the YAMLs name are the ones docker/
builds. tests/integration/test_ray_up.py walks gpu_nodes.yaml for real."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from helpers.net import free_port

# importing Ray's CLI module warns about pydantic APIs it uses; not this test's business
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "cluster_configs"
CLUSTER_YAMLS = ["gpu_nodes.yaml", "ascend_npu.yaml", "ascend_npu_a3.yaml", "aws.yaml"]
RECIPES = sorted(p.name for p in (REPO / "examples").glob("retool_*.yaml")) + ["gsm8k_lora_qwen2.5_1.5b.yaml"]
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
        if "ray start" not in command:  # other commands (the sandbox's) are shell this split would not parse
            continue
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


def container_run(config: dict, node_type: str | None = None) -> list[str]:
    """The `docker run` Ray issues for a node (ray 2.60: autoscaler._private.docker.docker_start_cmds),
    as words: docker.run_options, plus the node type's worker_run_options."""
    from ray.autoscaler._private.docker import docker_start_cmds

    docker = config["docker"]
    options = docker["run_options"] + (config["available_node_types"][node_type].get("docker", {}).get("worker_run_options", [])
                                       if node_type else [])
    return shlex.split(docker_start_cmds(config["auth"]["ssh_user"], docker["image"], {}, docker["container_name"], options,
                                         config["cluster_name"], "/home/raytool", "docker"))


def option_values(run: list[str], *names: str) -> list[str]:
    """The values of a `docker run` option in either spelling: `--device X`, `--device=X`."""
    values = []
    for i, word in enumerate(run):
        for name in names:
            if word == name:
                values.append(run[i + 1])
            elif word.startswith(name + "=") and name.startswith("--"):
                values.append(word.split("=", 1)[1])
    return values


def container_env(run: list[str]) -> dict[str, str]:
    return dict(value.split("=", 1) for value in option_values(run, "-e", "--env"))


def container_mounts(run: list[str]) -> dict[str, str]:
    """Bind mounts: container path -> host path."""
    return {value.split(":")[1]: value.split(":")[0] for value in option_values(run, "-v", "--volume")}


def npu_devices(run: list[str]) -> set[str]:
    return {d for d in option_values(run, "--device") if re.fullmatch(r"/dev/davinci\d+", d)}


def exported_on_every_node(config: dict) -> set[str]:
    """Variables every node's `ray start` command exports for Ray's processes (`export NAME=...;`)."""
    per_list = [{name for command in config[key] if "ray start" in command for name in re.findall(r"\bexport (\w+)=", command)}
                for key in ("head_start_ray_commands", "worker_start_ray_commands")]
    return per_list[0] & per_list[1]


def sandbox_service_commands(config: dict) -> list[str]:
    """The commands, head's then workers', that start the node's `raytool sandbox serve`."""
    return [command for key in ("head_start_ray_commands", "worker_start_ray_commands") for command in config[key]
            if "raytool sandbox serve" in command]


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


@pytest.mark.parametrize("name", ["gpu_nodes.yaml", "ascend_npu.yaml", "ascend_npu_a3.yaml"])
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


def test_gpu_nodes_containers_get_the_gpus_infiniband_shared_storage_and_the_nic():
    run = container_run(load("gpu_nodes.yaml"))
    assert run[run.index("--gpus") + 1] == "all"
    assert any(re.fullmatch(r"--shm-size=\d+g", word) for word in run)
    assert run.count("--net=host") == 1 and run[-2:] == ["raytool:gpu", "bash"]  # Ray adds the host network itself
    assert "/dev/infiniband" in option_values(run, "--device") and "IPC_LOCK" in option_values(run, "--cap-add")
    assert "memlock=-1" in option_values(run, "--ulimit")
    assert container_mounts(run) == {"/shared": "/shared", "/models": "/models"}
    assert "/models:/models:ro" in option_values(run, "-v")  # checkpoints are read, never written, there
    env = container_env(run)
    assert env["NCCL_SOCKET_IFNAME"] and env["GLOO_SOCKET_IFNAME"]


@pytest.mark.parametrize(("name", "npus"), [("ascend_npu.yaml", 8), ("ascend_npu_a3.yaml", 16)])
def test_ascend_nodes_get_their_npus_driver_hccl_settings_and_shared_storage(name, npus):
    """The container gets /dev/davinci0..N-1 (8 on A2, 16 on A3), the management devices and the
    host's driver files, and Ray on every node declares as many NPUs as the container has devices."""
    config = load(name)
    run = container_run(config)
    devices = set(option_values(run, "--device"))
    assert npu_devices(run) == {f"/dev/davinci{i}" for i in range(npus)}
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    mounts = container_mounts(run)
    assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info"} <= set(mounts)
    assert mounts["/shared"] == "/shared" and mounts["/models"] == "/models"
    env = container_env(run)
    assert int(env["HCCL_CONNECT_TIMEOUT"]) >= 120 and int(env["HCCL_BUFFSIZE"]) > 0
    assert env["HCCL_SOCKET_IFNAME"] and env["GLOO_SOCKET_IFNAME"]
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        ((_, args),) = ray_start_invocations(commands)
        assert json.loads(parse_ray_start(args)["resources"]) == {"NPU": npus}


def test_ascend_a3_file_is_the_a2_file_with_sixteen_npus_and_the_a3_image():
    """The two Ascend files differ only where A2 and A3 nodes differ, so a fix to one that misses
    the other fails here."""
    def normalized(config: dict) -> dict:
        config = copy.deepcopy(config)
        config.pop("cluster_name")
        config["provider"].pop("worker_ips")
        config["docker"].pop("image")
        config["docker"]["run_options"] = [o for o in config["docker"]["run_options"] if not re.fullmatch(r"--device=/dev/davinci\d+", o)]
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            config[key] = [re.sub(r'"NPU": \d+', '"NPU": n', command) for command in config[key]]
        return config

    a2, a3 = load("ascend_npu.yaml"), load("ascend_npu_a3.yaml")
    assert normalized(a2) == normalized(a3)
    assert (a2["docker"]["image"], a3["docker"]["image"]) == ("raytool:ascend", "raytool:ascend-a3")


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


def test_aws_nodes_export_the_nic_of_their_default_route():
    """The aws.yaml start commands point NCCL and gloo at the interface of the node's default route
    (EC2 names it differently per instance type); run here, the same lines find this machine's."""
    if not any(line.split()[1] == "00000000" for line in Path("/proc/net/route").read_text().splitlines()[1:]):
        pytest.skip("this machine has no default route")
    config = load("aws.yaml")
    assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= exported_on_every_node(config)
    (command,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    exports = " ".join(part + ";" for part in command.split(";") if part.strip().startswith("export "))
    found = subprocess.run(["bash", "-c", exports + ' echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"'],
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(found) == 2 and found[0] == found[1] and found[0] in os.listdir("/sys/class/net")


# --- Each recipe and the cluster file its header names ---

def recipe_cluster_files(recipe: str) -> list[str]:
    """The cluster files a recipe's header names: `# cluster file: cluster_configs/X.yaml [or ...]`."""
    lines = [line for line in (REPO / "examples" / recipe).read_text().splitlines() if line.startswith("# cluster file:")]
    assert len(lines) == 1, f"examples/{recipe}: expected one '# cluster file: cluster_configs/<file>.yaml' line in its header"
    return re.findall(r"cluster_configs/([\w.-]+\.yaml)", lines[0])


def accelerators_per_node(config: dict, accelerator: str) -> float:
    """The most accelerators one node of a cluster file gives both its container and Ray. NPU: the
    /dev/davinciN devices, and the "NPU" every `ray start` declares. GPU: `docker --gpus` (all:
    every GPU of the node, counted as unlimited), and `ray start --num-gpus` or, on a cloud
    provider, the node type's GPU resource where set."""
    starts = [parse_ray_start(args) for _, args in
              ray_start_invocations(config["head_start_ray_commands"] + config["worker_start_ray_commands"])]
    if accelerator == "NPU":
        declared = min(json.loads(opts["resources"] or "{}").get("NPU", 0) for opts in starts)
        return min(declared, len(npu_devices(container_run(config))))

    def gpus(run: list[str]) -> float:
        given = option_values(run, "--gpus")
        return float("inf") if "all" in given else max(map(int, given), default=0)

    if config["provider"]["type"] == "local":
        return min([gpus(container_run(config))] + [opts["num_gpus"] for opts in starts if opts["num_gpus"] is not None])
    return max(min(gpus(container_run(config, name)), node_type["resources"].get("GPU", 0))
               for name, node_type in config["available_node_types"].items())


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_names_a_cluster_file_whose_nodes_can_run_it(recipe, monkeypatch):
    """What a recipe needs of every node, given by the cluster file its header names: the
    accelerators per node, the shared directories it writes to and reads from, the NIC settings of
    its collectives, and the code sandbox its tool file calls, with room for all its cells."""
    from raytool.config import load_config
    from raytool.resolve import with_tool_sandbox_settings
    from raytool.tools import tool_config_sandbox_overrides

    monkeypatch.chdir(REPO)
    cfg = load_config(f"examples/{recipe}")
    if cfg.agent.tools and tool_config_sandbox_overrides(cfg.agent.tools).get("backend") == "sandbox_fusion":
        cfg = with_tool_sandbox_settings(cfg)  # the service URL and the cells per pool the run will use
    names = recipe_cluster_files(recipe)
    assert names, f"examples/{recipe} names no cluster file (for a one-machine recipe: the one to use on a cluster)"
    for name in names:
        assert (CONFIGS / name).is_file(), f"examples/{recipe} names cluster_configs/{name}, which does not exist"
        config = load(name)
        where = f"examples/{recipe} on cluster_configs/{name}"
        accelerator, per_node = cfg.cluster.accelerator, cfg.cluster.gpus_per_node or 0
        assert accelerators_per_node(config, accelerator) >= per_node, f"{where}: a node has fewer than {per_node} {accelerator}s"
        if config["provider"]["type"] == "local":
            assert 1 + len(config["provider"]["worker_ips"]) >= (cfg.cluster.nodes or 1), f"{where}: fewer nodes than cluster.nodes"

        run = container_run(config)
        mounts = container_mounts(run)
        for key, path in (("trainer.checkpoint_dir", cfg.trainer.checkpoint_dir), ("model.path", cfg.model.path)):
            if path.startswith("/"):
                top = "/" + path.split("/")[1]
                assert top in mounts, f"{where}: {key} {path} is under {top}, which the containers do not mount ({sorted(mounts)})"

        nics = {"GPU": {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}, "NPU": {"HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}}[accelerator]
        set_vars = {k for k, v in container_env(run).items() if v} | exported_on_every_node(config)
        assert nics <= set_vars, f"{where}: {sorted(nics - set_vars)} not set for the containers"

        if cfg.sandbox.backend == "sandbox_fusion":
            url = urllib.parse.urlsplit(cfg.sandbox.fusion_url)
            assert url.hostname in ("127.0.0.1", "localhost"), f"{where}: the tool file calls {url.hostname}, not the node's own service"
            assert container_env(run).get("RAYTOOL_SANDBOX_PORT") == str(url.port), f"{where}: the nodes' sandbox serves another port"
            head, worker = sandbox_service_commands(config)  # one each, and the same
            assert head == worker
            serve = shlex.split(re.search(r"raytool sandbox serve [^>&]*", head).group(0))
            assert serve[serve.index("--host") + 1] == url.hostname.replace("localhost", "127.0.0.1")
            assert serve[serve.index("--port") + 1] == "$RAYTOOL_SANDBOX_PORT"
            (capacity,) = [int(w.split("=")[1]) for w in serve if w.startswith("sandbox.max_concurrency=")]
            cells = cfg.sandbox.num_pools * cfg.sandbox.max_concurrency
            assert cells <= capacity, (f"{where}: {cfg.sandbox.num_pools} pools x sandbox.max_concurrency {cfg.sandbox.max_concurrency} = "
                                       f"{cells} cells at once, more than the node's sandbox runs ({capacity})")


def test_every_cluster_file_starts_the_same_sandbox_service_on_every_node():
    commands = {name: sandbox_service_commands(load(name)) for name in CLUSTER_YAMLS}
    assert all(len(found) == 2 for found in commands.values()), commands  # head and workers
    assert len({c for found in commands.values() for c in found}) == 1


FAKE_RAYTOOL = """#!{python}
# Stands in for `raytool sandbox serve`: records its arguments, answers GET /v1/ping on --port.
import http.server, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
if os.environ.get("FAKE_FAIL"):
    print("raytool: sandbox serve: port", args[args.index("--port") + 1], "is in use", file=sys.stderr)
    sys.exit(2)
with open(os.environ["FAKE_CALLS"] + ".pid", "w") as f:
    f.write(str(os.getpid()))

class Ping(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/ping" else 404)
        self.end_headers()
        self.wfile.write(b'"pong"')

print("serving", flush=True)
http.server.HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Ping).serve_forever()
"""


def test_node_sandbox_service_starts_once_in_the_background_and_reports_a_failed_start(tmp_path):
    """The start command (run as `ray up` runs it, twice) leaves one server running, logging to a
    file, and returns once it answers; a server that cannot start fails the command with its log."""
    command = sandbox_service_commands(load("gpu_nodes.yaml"))[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "raytool"
    fake.write_text(FAKE_RAYTOOL.format(python=sys.executable))
    fake.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    port = free_port()
    calls = tmp_path / "calls"
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_CALLS": str(calls)}

    def start(**extra):
        return subprocess.run(["bash", "-c", command], env={**env, **extra}, capture_output=True, text=True, timeout=60)

    assert start().returncode == 0 and not calls.exists()  # no RAYTOOL_SANDBOX_PORT (no Docker): nothing started
    try:
        for _ in range(2):
            done = start(RAYTOOL_SANDBOX_PORT=str(port))
            assert done.returncode == 0, done.stdout + done.stderr
        assert calls.read_text() == f"sandbox serve --host 127.0.0.1 --port {port} sandbox.max_concurrency=128\n"
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/ping", timeout=5).status == 200
        assert "serving" in (tmp_path / "raytool-sandbox.log").read_text()
    finally:
        if Path(f"{calls}.pid").exists():
            os.kill(int(Path(f"{calls}.pid").read_text()), signal.SIGTERM)

    t0 = time.monotonic()
    failed = start(RAYTOOL_SANDBOX_PORT=str(port), FAKE_FAIL="1")
    assert failed.returncode == 1 and f"port {port} is in use" in failed.stdout
    assert time.monotonic() - t0 < 30  # it stops waiting when the server has exited


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
    assert re.search(r"pip install .*(\s\.\s|\s\.$|\s\"\.\[[a-z0-9,_-]+\]\")|scripts/setup\.sh", runs), f"{path.name}: no RUN installs raytool"
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


def documented_builds(text: str) -> dict[str, tuple[Path, dict[str, str]]]:
    """`docker build -f FILE [--build-arg K=V ...] -t NAME` lines in comments: NAME -> (FILE, build args)."""
    builds = {}
    for line in re.findall(r"^#\s*(docker build .*)$", text, re.M):
        words = shlex.split(line.split("#")[0])
        if "-f" in words and "-t" in words:
            args = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg" and "=" in words[i + 1])
            builds[words[words.index("-t") + 1]] = (REPO / words[words.index("-f") + 1], args)
    return builds


@pytest.mark.parametrize("name", CLUSTER_YAMLS)
def test_cluster_yaml_runs_one_image_that_docker_builds(name):
    """Each image a cluster YAML names (after an optional registry prefix) is the tag one of the
    Dockerfiles documents, or one the YAML's own header says how to build from a Dockerfile in this
    repository, with build args that Dockerfile declares (the A3 image: ascend.Dockerfile on the -a3
    base). One cluster runs one image: Ray needs one Ray and Python version on every node."""
    tags = {built_tag(path) for path in DOCKERFILES}
    text = (CONFIGS / name).read_text()
    own = documented_builds(text)
    config = yaml.safe_load(text)
    docker = config["docker"]
    images = {docker[k] for k in ("image", "head_image", "worker_image") if k in docker}
    images |= {t["docker"]["worker_image"] for t in config.get("available_node_types", {}).values() if "worker_image" in t.get("docker", {})}
    built = {image.rsplit("/", 1)[-1] for image in images}
    assert built <= tags | set(own), f"{name} names {built - tags - set(own)}, which no Dockerfile or header builds ({sorted(tags)})"
    assert len(built) == 1
    for tag in built - tags:
        dockerfile, args = own[tag]
        assert dockerfile in DOCKERFILES, f"{name}: builds {tag} from {dockerfile}, not one of {DOCKERFILES}"
        declared = {re.match(r"\w+", a).group(0) for op, a in dockerfile_instructions(dockerfile) if op == "ARG"}
        assert set(args) <= declared, f"{name}: --build-arg {sorted(set(args) - declared)} is not an ARG of {dockerfile.name}"
