"""The `ray up` walk for real: cluster_configs/gpu_nodes.yaml, turned into a one-node CPU cluster on
this machine, goes up over SSH, runs `raytool train` as a token-authenticated Ray job, and comes
down again with nothing of it left running.

The "node" is this machine seen through Debian's sshd, started on a free loopback port with its own
host key and an authorized key made for the test, inside its own PID and mount namespaces. Why the
namespaces: `ray stop` (which `ray down` runs on every node, and the YAML's start commands run
first) stops every Ray process it can see, and other test sessions may run their own Ray heads on
this machine; in the namespace it sees only the walk's. The mount namespace also gives the node's
root a home of its own (a copy of /etc/passwd pointing it at a temporary directory), so the
node-side files `ray up` writes (~/.bashrc, ~/ray_bootstrap_*, ~/.ray/auth_token) stay out of the
real /root, and a /tmp/ray of its own. Needs root, sshd, ssh, ssh-keygen, nc (netcat-openbsd),
rsync and unshare: CI installs them with scripts/system_deps.sh.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from helpers.net import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SSHD = "/usr/sbin/sshd"
TOOLS = {"sshd": SSHD, "ssh": "ssh", "ssh-keygen": "ssh-keygen", "nc": "nc", "rsync": "rsync", "unshare": "unshare"}
TRAIN = ["-c", "examples/tiny_cpu.yaml", "rollout.engine=hf", "trainer.total_steps=1", "trainer.sft_warmup_steps=1",
         "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens_per_turn=24", "agent.max_response_tokens=64",
         "eval.before_train=false", "eval.after_train=false", "trainer.save_final=false"]


def run(cmd: list[str], log: Path, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a CLI step, its output kept in `log` (shown when an assertion about it fails)."""
    with open(log, "w") as out:
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`{' '.join(cmd[:3])}` ran past {timeout} s:\n{tail(log)}") from None


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


class NamespacedSSHNode:
    """Debian's sshd on 127.0.0.1:<port>, as PID 1 of its own PID namespace (everything started over
    SSH lives and dies with it), root's home inside the namespace being `home`."""

    def __init__(self, workdir: Path):
        workdir.mkdir()
        self.port = free_port()
        self.home = workdir / "home"
        self.home.mkdir()
        self.key = workdir / "id_walk"
        host_key = workdir / "ssh_host_ed25519_key"
        for path in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raytool-walk", "-f", str(path)], check=True)
        (workdir / "authorized_keys").write_text((workdir / "id_walk.pub").read_text())
        (workdir / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {workdir}/sshd.pid\n"
            f"AuthorizedKeysFile {workdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nMaxSessions 64\nMaxStartups 64\nLogLevel ERROR\n")
        passwd = Path("/etc/passwd").read_text()
        (workdir / "passwd").write_text(re.sub(r"^(root:[^:]*:0:0:[^:]*:)[^:]*:", rf"\g<1>{self.home}:", passwd, flags=re.M))
        self.made_privsep_dir = not Path("/run/sshd").exists()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        # /tmp/ray of its own too: `ray stop` deletes /tmp/ray/ray_current_cluster (the address other
        # Ray users on this machine attach to), and the head's session files stay with the walk.
        (workdir / "tmp_ray").mkdir()
        Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
        script = (f"mount --bind {workdir}/passwd /etc/passwd && mount --bind {workdir}/tmp_ray {tempfile.gettempdir()}/ray"
                  f" && exec {SSHD} -D -e -f {workdir}/sshd_config")
        self.log = workdir / "sshd.log"
        self._log_file = open(self.log, "w")
        # --kill-child: if this test dies, the namespace's init dies, and with it everything in it
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", "-c", script],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_listening()
        self.init_pid = self._init_pid()
        self.pid_ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")

    def _wait_listening(self, timeout_s: float = 20.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited ({self.proc.returncode}): {tail(self.log)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"sshd did not listen on {self.port}: {tail(self.log)}")

    def _init_pid(self) -> int:
        import psutil

        (child,) = psutil.Process(self.proc.pid).children()
        return child.pid

    def processes(self) -> list:
        """Live processes in the node's PID namespace other than sshd itself and its sessions."""
        import psutil

        found = []
        for proc in psutil.process_iter(["name", "cmdline", "status"]):
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/pid") != self.pid_ns or proc.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if proc.info["name"] == "sshd" or (proc.info["cmdline"] or [""])[0].startswith("sshd"):
                    continue
                found.append(proc)
            except (OSError, psutil.Error):
                continue
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self._log_file.close()
        if self.made_privsep_dir:
            try:
                Path("/run/sshd").rmdir()
            except OSError:
                pass


def walk_config(node: NamespacedSSHNode, cluster_name: str, ports: dict[str, int]) -> dict:
    """gpu_nodes.yaml, changed only where this machine differs from a GPU cluster: the node is
    127.0.0.1 behind `nc` to sshd's port, root with the test's key; no Docker (CPU, this repo's
    .venv put on the login PATH by the YAML's own setup line); every Ray port the walk's own, the
    dashboard on loopback."""
    config = yaml.safe_load((REPO / "cluster_configs" / "gpu_nodes.yaml").read_text())
    config["cluster_name"] = cluster_name
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(node.key), "ssh_proxy_command": f"nc 127.0.0.1 {node.port}"}
    del config["docker"]
    setup = [c.replace("/opt/raytool/.venv/bin", str(VENV_BIN)) for c in config["setup_commands"]]
    assert setup != config["setup_commands"], "gpu_nodes.yaml's setup no longer puts /opt/raytool/.venv/bin on the PATH"
    config["setup_commands"] = setup
    flags = {"port": ports["gcs"], "object-manager-port": ports["object_manager"], "dashboard-port": ports["dashboard"],
             "dashboard-host": "127.0.0.1"}
    extra = (f" --node-manager-port={ports['node_manager']} --dashboard-agent-listen-port={ports['agent_http']}"
             f" --dashboard-agent-grpc-port={ports['agent_grpc']} --runtime-env-agent-port={ports['runtime_env_agent']}"
             f" --metrics-export-port={ports['metrics']} --ray-client-server-port={ports['client']}")
    head = []
    for command in config["head_start_ray_commands"]:
        if "ray start" in command:
            for flag, value in flags.items():
                command, n = re.subn(rf"--{flag}=\S+", f"--{flag}={value}", command)
                assert n == 1, f"gpu_nodes.yaml's head start command has no --{flag}"
            command += extra
        head.append(command)
    config["head_start_ray_commands"] = head
    return config


def ray_processes_of(gcs_port: int) -> list[str]:
    """Every process on this machine whose command line names the walk's GCS (address or port)."""
    import psutil

    mark = re.compile(rf"(\d:{gcs_port}|--gcs_server_port={gcs_port})\b")
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if proc.info["status"] != psutil.STATUS_ZOMBIE and mark.search(line) and proc.pid != os.getpid():
            found.append(f"{proc.pid}: {line[:200]}")
    return found


def test_ray_up_job_submit_ray_down(tmp_path):
    missing = [name for name, exe in TOOLS.items() if not shutil.which(exe)]
    if missing:
        pytest.skip(f"the ray up walk needs {', '.join(missing)}: install them with scripts/system_deps.sh (CI does)")
    if os.geteuid() != 0:
        pytest.skip("the ray up walk needs root (its sshd runs in its own PID and mount namespaces)")

    from ray.job_submission import JobStatus, JobSubmissionClient

    from raytool.models import resolve_model

    ray_cli = str(VENV_BIN / "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if not (Path.home() / ".ray" / "auth_token").is_file() and not os.environ.get("RAY_AUTH_TOKEN"):
        subprocess.run([ray_cli, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    model = resolve_model("tiny-random")  # built here once; the job reads it by path

    cluster_name = f"raytool-walk-{uuid.uuid4().hex[:8]}"
    ports = {name: free_port() for name in ("gcs", "object_manager", "dashboard", "node_manager", "agent_http",
                                            "agent_grpc", "runtime_env_agent", "metrics", "client")}
    dashboard = f"http://127.0.0.1:{ports['dashboard']}"
    config_path = tmp_path / "walk.yaml"
    run_dir = tmp_path / "run"
    logs = {step: tmp_path / f"{step}.log" for step in ("up", "submit", "down")}
    timings: dict[str, float] = {}
    node = None
    up = down = False
    t_start = time.monotonic()
    try:
        node = NamespacedSSHNode(tmp_path / "node")
        config_path.write_text(yaml.safe_dump(walk_config(node, cluster_name, ports), sort_keys=False))

        t0 = time.monotonic()
        done = run([ray_cli, "up", "-y", "--no-config-cache", "--log-style", "record", "--log-color", "false", str(config_path)],
                   logs["up"], timeout=600, env=env, cwd=REPO)
        up = True
        timings["ray up"] = time.monotonic() - t0
        assert done.returncode == 0, f"ray up failed:\n{tail(logs['up'])}"

        t0 = time.monotonic()
        client = None
        while client is None:  # the job API answers a moment after `ray start` returns
            try:
                client = JobSubmissionClient(dashboard)
            except Exception:
                assert time.monotonic() - t0 < 60, "the dashboard's job API did not answer within 60 s"
                time.sleep(1)
        submission = f"{cluster_name}-train"
        done = run([ray_cli, "job", "submit", "--address", dashboard, "--submission-id", submission, "--no-wait",
                    "--runtime-env", "cluster_configs/runtime_env.yaml", "--",
                    "raytool", "train", *TRAIN, f"model.path={model}", "--run-dir", str(run_dir)],
                   logs["submit"], timeout=300, env=env, cwd=REPO)
        assert done.returncode == 0, f"ray job submit failed:\n{tail(logs['submit'])}"
        deadline = time.monotonic() + 900
        while (status := client.get_job_status(submission)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.monotonic() < deadline, f"job still {status} after 900 s:\n{client.get_job_logs(submission)[-4000:]}"
            time.sleep(3)
        timings["job"] = time.monotonic() - t0
        assert status == JobStatus.SUCCEEDED, f"job {status}:\n{client.get_job_logs(submission)[-6000:]}"
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # the one GRPO step, written by the job

        t0 = time.monotonic()
        done = run([ray_cli, "down", "-y", "--log-style", "record", "--log-color", "false", str(config_path)],
                   logs["down"], timeout=300, env=env, cwd=REPO)
        timings["ray down"] = time.monotonic() - t0
        assert done.returncode == 0, f"ray down failed:\n{tail(logs['down'])}"
        down = True
        # `ray down` only warns when `ray stop` fails on a node (e.g. ray not on the login PATH)
        assert "Exception occurred when stopping the cluster Ray runtime" not in logs["down"].read_text(), tail(logs["down"])

        deadline = time.monotonic() + 30
        while (left := node.processes()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, "still running on the node after ray down:\n" + "\n".join(
            f"{p.pid}: {' '.join(p.cmdline())[:200]}" for p in left)
        assert not ray_processes_of(ports["gcs"])
        timings["total"] = time.monotonic() - t_start
        print("\nray up walk: " + ", ".join(f"{step} {seconds:.0f} s" for step, seconds in timings.items()))
    finally:
        if up and not down:
            subprocess.run([ray_cli, "down", "-y", str(config_path)], env=env, cwd=REPO, capture_output=True, timeout=300)
        if node is not None:
            node.stop()  # ends the namespace: whatever the walk left running goes with it
        for suffix in (".state", ".lock"):  # the local provider's record of this cluster
            Path(tempfile.gettempdir(), "ray", f"cluster-{cluster_name}{suffix}").unlink(missing_ok=True)
        for cached in Path(tempfile.gettempdir()).glob("ray-config-*"):  # `ray down` caches the resolved config
            if cluster_name in cached.read_text(errors="replace"):
                cached.unlink(missing_ok=True)
        # ray up's SSH control sockets for this cluster (/tmp/ray_ssh_<user>/<cluster>, hashes of 10)
        control = Path("/tmp", f"ray_ssh_{hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]}")
        shutil.rmtree(control / hashlib.sha256(cluster_name.encode()).hexdigest()[:10], ignore_errors=True)
        try:
            control.rmdir()
        except OSError:
            pass
