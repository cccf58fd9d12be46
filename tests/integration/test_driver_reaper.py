"""A killed driver leaves nothing behind: the local Ray instance its `connect` started (GCS, raylet,
dashboard, the raylet's agents and workers) ends with it, by raytool.reaper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.integration

DRIVER = """
import ray
from actors.drivers.session import connect

connect(None)

@ray.remote(num_cpus=0)
class Held:
    def ping(self):
        return "pong"

held = Held.remote()
assert ray.get(held.ping.remote()) == "pong"
print("ready", flush=True)
import time
time.sleep(600)
"""


def test_a_killed_driver_takes_its_local_ray_instance_with_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local instance, not the suite's cluster
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        assert driver.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the reaper's next look at the tree
        family = [p for p in psutil.Process(driver.pid).children(recursive=True)]
        names = " ".join(p.name() + " " + " ".join(p.cmdline()[:1]) for p in family)
        assert "raylet" in names and "gcs_server" in names and any("reaper" in " ".join(p.cmdline()) for p in family)
        ray_family = [p for p in family if "raytool.reaper" not in " ".join(p.cmdline())]
        agents = [p for p in ray_family if "Agent" in " ".join(p.cmdline())]
        assert agents, "the DashboardAgent / RuntimeEnvAgent this test is about did not start"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        gone, alive = psutil.wait_procs(ray_family, timeout=30)
        assert not alive, f"still running 30 s after the driver was killed: {[(p.pid, ' '.join(p.cmdline())[:80]) for p in alive]}"
    finally:
        if driver.poll() is None:
            driver.kill()
