import asyncio

import pytest

from raytool.sandbox.local import LocalBackend


def run(code, **kw):
    backend = LocalBackend(max_output_bytes=kw.pop("max_output_bytes", 8192))
    return asyncio.run(backend.run(code, timeout_s=kw.pop("timeout_s", 5.0), memory_mb=kw.pop("memory_mb", 512)))


def test_ok_and_error():
    ok = run("print(sum(range(10)))")
    assert ok.status == "ok" and ok.stdout == "45\n" and ok.exit_code == 0
    err = run("raise ValueError('boom')")
    assert err.status == "error" and "ValueError: boom" in err.stderr


def test_timeout_kills_the_cell():
    r = run("import time\nwhile True: time.sleep(0.01)", timeout_s=0.5)
    assert r.status == "timeout" and r.duration_s < 3


def test_memory_limit():
    assert run("x = bytearray(1 << 31)", memory_mb=256).status == "oom"


def test_output_is_truncated():
    r = run("print('x' * 10000)", max_output_bytes=100)
    assert r.truncated and len(r.stdout) == 100


def test_cells_do_not_share_files_or_environment():
    run("open('leak.txt', 'w').write('secret')")
    r = run("import os; print(os.path.exists('leak.txt'), sorted(os.environ).count('HOME'))")
    assert r.stdout.strip() == "False 1"


def test_no_network_when_the_kernel_allows_isolation():
    backend = LocalBackend()
    if not backend.ns_prefix:
        return  # the warning at construction already told the user; nothing to check here
    r = asyncio.run(backend.run("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", timeout_s=5, memory_mb=512))
    assert r.status == "error" and "unreachable" in r.stderr.lower()


def test_processes_started_by_a_cell_die_with_it():
    backend = LocalBackend()
    if not backend.ns_prefix:
        pytest.skip("needs `unshare --pid` (root or user namespaces)")
    code = "import subprocess\nsubprocess.Popen(['sleep', '123.5'], start_new_session=True)\nprint('started')"
    r = asyncio.run(backend.run(code, timeout_s=5, memory_mb=512))
    assert r.status == "ok" and r.stdout == "started\n"
    import subprocess
    import time

    time.sleep(0.3)
    assert subprocess.run(["pgrep", "-f", "sleep 123.5"], capture_output=True).returncode == 1  # none left
