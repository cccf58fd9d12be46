"""One walled-in LocalBackend per isolation mode for the whole security suite, and the host-side
secrets and processes its cells must not reach.

Modes: "root" (each session a uid of its own; what a root host gets) and "userns" (the zygote in a
user namespace, cells in a nested one; what non-root hosts and unprivileged containers get).
The backend runs on an event loop of its own that the (synchronous) tests drive; its temp dirs go
to a private temp dir, so the final test can check that nothing of it is left there.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytool.sandbox.local import LocalBackend
from raytool.types import ExecResult

LIMITS = {"max_output_bytes": 4096, "memory_mb": 256, "disk_mb": 32, "max_processes": 32, "max_open_files": 128}
SECRET_ENV = "RAYTOOL_SECURITY_SECRET"


class Sandbox:
    """A LocalBackend plus the loop it runs on; `run` blocks until the cell's result is in."""

    def __init__(self, backend: LocalBackend, mode: str):
        self.backend = backend
        self.mode = mode
        self.loop = asyncio.new_event_loop()

    def run(self, code: str, session: str | None = None, timeout_s: float = 2.0) -> ExecResult:
        return self.loop.run_until_complete(self.backend.run(code, session=session, timeout_s=timeout_s))

    def close_session(self, name: str) -> None:
        self.loop.run_until_complete(self.backend.close_session(name))

    def idle(self, seconds: float) -> None:
        """Let time pass with the backend's loop running (so the fork-server's events flow)."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def wait_until(self, done, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self.idle(0.05)
        return True

    def assert_serves_a_normal_cell(self, session: str | None = None) -> None:
        r = self.run("print(6*7)", session=session)
        assert (r.status, r.stdout) == ("ok", "42\n"), f"the backend did not serve a normal cell after a hostile one: {r}"


@dataclass
class HostSecrets:
    value: str  # in the test process's environment (as `env_name`) and in every secret file
    env_name: str
    files: dict[str, Path]  # where it lies on the host: /tmp, ~/.ray, ~/.ssh


@pytest.fixture(scope="session")
def host_secrets():
    """A secret in this process's environment and in files under the host's /tmp and $HOME."""
    value = "s3cr3t-" + secrets.token_hex(16)
    tag = secrets.token_hex(4)
    home = Path.home()
    files = {
        "host /tmp": Path(tempfile.gettempdir()) / f"raytool-security-secret-{tag}.txt",
        "~/.ray auth token": home / ".ray" / f"auth_token_raytool_security_{tag}",
        "~/.ssh private key": home / ".ssh" / f"id_raytool_security_{tag}",
    }
    made_dirs = []
    for path in files.values():
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700)
            made_dirs.append(path.parent)
        path.write_text(value + "\n")
        path.chmod(0o600)
    os.environ[SECRET_ENV] = value
    try:
        yield HostSecrets(value, SECRET_ENV, files)
    finally:
        os.environ.pop(SECRET_ENV, None)
        for path in files.values():
            path.unlink(missing_ok=True)
        for d in made_dirs:
            try:
                d.rmdir()
            except OSError:  # something else put files there meanwhile: leave it
                pass


@pytest.fixture(scope="session")
def private_tmp():
    """The host temp dir the backend sees during the suite (so leftovers are unambiguous)."""
    saved = tempfile.tempdir
    path = tempfile.mkdtemp(prefix="raytool-security-tmp-")
    tempfile.tempdir = path
    try:
        yield Path(path)
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(path)


@pytest.fixture(scope="session", params=["root", "userns"])
def sandbox(request, host_secrets, private_tmp):
    """One started backend per mode; the secrets exist before its fork-server starts."""
    sb = Sandbox(LocalBackend(**LIMITS, force_userns=request.param == "userns"), request.param)
    sb.loop.run_until_complete(sb.backend.start())
    caps = sb.backend.stats()["isolation"]
    if not (caps["netns"] and caps["mountns"] and caps["pidns"] and caps["setuid"] and caps["userns"] == (request.param == "userns")):
        sb.loop.run_until_complete(sb.backend.aclose())
        sb.loop.close()
        pytest.skip(f"the {request.param} mode needs root with network, mount and PID namespaces (and a user namespace for userns); this host gives {caps}")
    try:
        yield sb
    finally:
        sb.loop.run_until_complete(sb.backend.aclose())  # a second aclose after the final test is harmless
        sb.loop.close()


@pytest.fixture
def sentinel():
    """A host process no cell may kill."""
    proc = subprocess.Popen(["sleep", "4246.5"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
