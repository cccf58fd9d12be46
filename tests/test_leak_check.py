"""The suite's leak check (tests/conftest.py) fails a test that leaves a process or a thread
running, naming it, and lets one whose fixture stops what it started pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

LEAKY = '''
import subprocess, sys, threading, time
import pytest

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(61)  # leaked on purpose"])

def test_leaves_a_thread():
    threading.Thread(target=time.sleep, args=(60,), name="forgotten", daemon=True).start()

@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()

def test_a_fixture_that_stops_its_process(server):
    assert server.poll() is None

def test_stops_its_own_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    proc.wait()
'''


def test_a_test_that_leaves_a_process_or_thread_running_fails_naming_it(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "helpers").mkdir()
    shutil.copy(Path(__file__).with_name("helpers") / "net.py", tmp_path / "helpers" / "net.py")  # the conftest imports it
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    import psutil

    for p in psutil.process_iter(["cmdline"]):  # the process leaked on purpose outlives the inner session
        if "leaked on purpose" in " ".join(p.info["cmdline"] or []):
            p.kill()
    text = out.stdout
    assert "4 passed, 2 errors" in text, text[-3000:]
    assert "ERROR at teardown of test_leaves_a_process" in text and "left running after the test: process" in text
    assert "ERROR at teardown of test_leaves_a_thread" in text and "left running after the test: thread 'forgotten'" in text
