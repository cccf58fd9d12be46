"""Hostile cells against the local sandbox: each must be contained with the right status, leave
the host untouched, and leave the backend serving the next cell.

Every test runs once per isolation mode (see conftest.py); pytest runs all of one mode before the
other. The last test closes that mode's backend and checks that it leaves no process and no temp
dir behind, so it must stay last in this file.
"""

import errno
import os
import socket
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytool.sandbox.local import ZYGOTE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MARKERS = {  # the sleeps cells leave behind, found on the host by their exact command line
    "orphan": ["sleep", "4242.5"],
    "daemon": ["sleep", "4243.5"],
    "session": ["sleep", "4244.5"],
    "neighbour": ["sleep", "4245.5"],
}


@dataclass
class HostProcess:
    pid: int
    comm: str  # the thread name, which a cell can set (prctl PR_SET_NAME) and its forks inherit
    argv: list[str]


def host_processes() -> list[HostProcess]:
    """Every process this host's /proc shows, with its name and command line."""
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            comm = Path(f"/proc/{name}/comm").read_text().strip()
        except OSError:  # it ended while we looked
            continue
        procs.append(HostProcess(int(name), comm, argv))
    return procs


def processes_running(argv: list[str]) -> list[int]:
    """Processes running `argv`. A process that has just been exec'd can show an empty command
    line for a moment after Popen returned in its parent (the kernel closes the exec-error pipe
    before it sets the new argument pages), so a check that one runs must wait for it."""
    return [p.pid for p in host_processes() if p.argv == argv]


def processes_named(comm: str) -> list[int]:
    return [p.pid for p in host_processes() if p.comm == comm]


def our_zygote_processes() -> list[int]:
    """The fork-server and every session forked from it that this test process started."""
    marker = f'"parent_pid": {os.getpid()}'
    return [p.pid for p in host_processes() if any(ZYGOTE in a for a in p.argv) and any(marker in a for a in p.argv)]


def cell(code: str) -> str:
    return textwrap.dedent(code).strip("\n")


# -- CPU, memory, processes, files, output ---------------------------------------------------------


NAME_ME = "import ctypes\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)  # PR_SET_NAME: forks inherit it\n"


def test_fork_bomb_times_out_and_leaves_no_process(sandbox):
    r = sandbox.run(NAME_ME.format(name="rt-forkbomb") + cell("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """), timeout_s=1)
    assert r.status == "timeout", r
    left = lambda: processes_named("rt-forkbomb")  # noqa: E731
    assert sandbox.wait_until(lambda: not left()), f"the fork bomb's processes outlived it: {left()}"
    sandbox.assert_serves_a_normal_cell()


def test_forking_stops_at_the_process_limit(sandbox):
    r = sandbox.run(NAME_ME.format(name="rt-forklimit") + cell("""
        import os, time
        n = 0
        try:
            while n < 200:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print(n, exc.errno)
    """))
    assert r.status == "ok", r
    assert r.stdout, "200 forks went through: the process limit is not enforced"
    forked, err = map(int, r.stdout.split())
    assert forked < sandbox.backend.limits["max_processes"] and err == errno.EAGAIN
    assert sandbox.wait_until(lambda: not processes_named("rt-forklimit")), "the forked children outlived their cell"
    sandbox.assert_serves_a_normal_cell()


@pytest.mark.parametrize("code", [
    "x = []\nwhile True:\n    x.append(bytearray(1 << 20))",
    "import numpy as np\nx = np.ones(1 << 30)",  # 8 GiB
], ids=["python-list", "numpy"])
def test_memory_bomb_is_oom(sandbox, code):
    r = sandbox.run(code)
    assert r.status == "oom", r
    assert "MemoryError" in r.stderr
    sandbox.assert_serves_a_normal_cell()


def test_infinite_loop_times_out(sandbox):
    r = sandbox.run("while True:\n    pass", timeout_s=1)
    assert r.status == "timeout" and "ran past its 1 s limit" in r.stderr, r
    assert r.duration_s < 3
    sandbox.assert_serves_a_normal_cell()


def test_busy_threads_time_out(sandbox):
    r = sandbox.run(cell("""
        import threading
        def spin():
            while True:
                pass
        threads = [threading.Thread(target=spin) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    """), timeout_s=1)
    assert r.status == "timeout", r
    assert r.duration_s < 3
    sandbox.assert_serves_a_normal_cell()


def test_sleeping_past_the_timeout_while_ignoring_sigterm_is_killed(sandbox):
    r = sandbox.run(cell("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        time.sleep(100)
    """), timeout_s=1)
    assert r.status == "timeout", r
    assert r.duration_s < 3
    sandbox.assert_serves_a_normal_cell()


def test_many_threads_are_refused(sandbox):
    r = sandbox.run(cell("""
        import threading, time
        for _ in range(10_000):
            threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    """))
    assert r.status == "error" and "RuntimeError: can't start new thread" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


def test_many_open_files_are_refused(sandbox):
    r = sandbox.run("files = [open('/dev/null') for _ in range(100_000)]")
    assert r.status == "error" and f"[Errno {errno.EMFILE}] Too many open files" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


@pytest.mark.parametrize("code, refusal", [
    ("with open('fill-big', 'wb') as f:\n    for _ in range(64):\n        f.write(bytes(1 << 20))", f"[Errno {errno.EFBIG}] File too large"),
    ("for i in range(64):\n    open(f'fill-{i}', 'wb').write(bytes(1 << 20))", f"[Errno {errno.ENOSPC}] No space left on device"),
], ids=["one-big-file", "many-files"])
def test_filling_the_disk_is_refused(sandbox, private_tmp, code, refusal):
    r = sandbox.run(code)
    assert r.status == "error" and refusal in r.stderr, r
    assert list(private_tmp.rglob("fill-*")) == [], "the cell's files reached the host's disk"
    sandbox.assert_serves_a_normal_cell()


def test_a_gigabyte_of_stdout_is_capped(sandbox):
    r = sandbox.run(cell("""
        import sys
        chunk = 'x' * (1 << 20)
        for _ in range(1024):
            sys.stdout.write(chunk)
    """), timeout_s=2)
    assert r.status in ("ok", "timeout"), r
    assert r.truncated and len(r.stdout) <= sandbox.backend.max_output_bytes, f"{len(r.stdout)} characters came back"
    assert r.stdout.startswith("x" * 1000) and r.stdout.endswith("x" * 1000)
    sandbox.assert_serves_a_normal_cell()


def test_binary_and_invalid_utf8_output_is_decoded_with_replacement(sandbox):
    r = sandbox.run(cell(r"""
        import sys
        sys.stdout.buffer.write(b'abc\xff\xfe\x80def\x00\n')
        _ = sys.stderr.buffer.write(b'\xc3(\n')  # assigned: a trailing expression's value is echoed
    """))
    assert r.status == "ok", r
    assert r.stdout == "abc\ufffd\ufffd\ufffddef\x00\n" and r.stderr == "\ufffd(\n"
    sandbox.assert_serves_a_normal_cell()


def test_deep_recursion_is_a_recursion_error(sandbox):
    r = sandbox.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert r.status == "error" and "RecursionError: maximum recursion depth exceeded" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


def test_c_stack_overflow_kills_the_interpreter_and_the_session_says_so(sandbox):
    assert sandbox.run("state = 'set before the crash'", session="deep").status == "ok"
    r = sandbox.run(cell("""
        import sys
        sys.setrecursionlimit(10**6)
        f = lambda n: list(map(f, [n + 1]))  # through C (map), so each level costs C stack
        f(0)
    """), session="deep")
    assert r.status == "killed" and "SIGSEGV" in r.stderr, r
    after = sandbox.run("print(state)", session="deep")
    assert after.status == "error" and "NameError" in after.stderr, after
    assert "earlier interpreter died (killed)" in after.stderr
    sandbox.assert_serves_a_normal_cell(session="deep")
    sandbox.close_session("deep")
    sandbox.assert_serves_a_normal_cell()


# -- network -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('1.1.1.1', 443), timeout=1)",
    "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
], ids=["tcp", "udp"])
def test_no_egress(sandbox, code):
    r = sandbox.run(code)
    assert r.status == "error" and f"[Errno {errno.ENETUNREACH}] Network is unreachable" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


def test_no_dns(sandbox):
    r = sandbox.run("import socket\nsocket.getaddrinfo('example.com', 443)")
    assert r.status == "error" and "socket.gaierror" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


def test_no_connection_to_a_host_loopback_tcp_service(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert r.status == "error" and f"[Errno {errno.ENETUNREACH}] Network is unreachable" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


def test_no_connection_to_a_host_abstract_unix_socket(sandbox):
    name = f"\0raytool-security-{id(sandbox)}"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen()
        r = sandbox.run(f"import socket\nsocket.socket(socket.AF_UNIX).connect({name!r})")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert r.status == "error" and "ConnectionRefusedError" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


# -- secrets -----------------------------------------------------------------------------------------


def test_the_hosts_environment_is_not_visible(sandbox, host_secrets):
    r = sandbox.run("import os\nprint(sorted(os.environ.items()))")
    assert r.status == "ok", r
    assert host_secrets.value not in r.stdout and host_secrets.env_name not in r.stdout
    assert "('HOME', '/sandbox')" in r.stdout
    sandbox.assert_serves_a_normal_cell()


def test_no_process_environment_holds_the_hosts_secret(sandbox, host_secrets):
    r = sandbox.run(cell("""
        import glob
        for path in glob.glob('/proc/*/environ'):
            try:
                print(path, open(path, 'rb').read())
            except OSError as exc:
                print(path, type(exc).__name__)
    """))
    assert r.status == "ok" and "/proc/self/environ" in r.stdout, r
    assert host_secrets.value not in r.stdout and host_secrets.env_name not in r.stdout
    sandbox.assert_serves_a_normal_cell()


def test_pid_1s_environment_is_not_readable(sandbox, host_secrets):
    r = sandbox.run("print(open('/proc/1/environ', 'rb').read())")
    assert r.status == "error" and "PermissionError" in r.stderr, r
    assert host_secrets.value not in r.stdout + r.stderr
    sandbox.assert_serves_a_normal_cell()


def test_the_test_process_is_not_visible(sandbox, host_secrets):
    r = sandbox.run(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
    assert r.status == "error" and "FileNotFoundError" in r.stderr, r
    assert host_secrets.value not in r.stdout + r.stderr
    sandbox.assert_serves_a_normal_cell()


@pytest.mark.parametrize("where", ["host /tmp", "~/.ray auth token", "~/.ssh private key"])
def test_host_secret_files_are_not_readable(sandbox, host_secrets, where):
    path = host_secrets.files[where]
    assert path.read_text().strip() == host_secrets.value  # it is there on the host
    r = sandbox.run(f"print(open({str(path)!r}).read())")
    assert r.status == "error" and "FileNotFoundError" in r.stderr, r
    assert host_secrets.value not in r.stdout + r.stderr
    sandbox.assert_serves_a_normal_cell()


EROFS = f"[Errno {errno.EROFS}] Read-only file system"
ENOENT = f"[Errno {errno.ENOENT}] No such file or directory"


@pytest.mark.parametrize("directory, refusals", [
    ("/etc", [EROFS]),
    ("/usr", [EROFS]),
    # allowed: the cell's /tmp is its own /sandbox, unless the interpreter itself is installed under
    # /tmp (a CI checkout): then /tmp is the read-only view that holds it (TMPDIR still points to /sandbox)
    ("/tmp", [EROFS] if os.path.realpath(sys.prefix).startswith("/tmp/") else []),
    (str(REPO), [EROFS, ENOENT]),  # read-only when the venv inside it is bound, absent otherwise
    (sysconfig.get_paths()["purelib"], [EROFS]),  # the interpreter's packages, shared by every cell
], ids=["etc", "usr", "tmp", "repo", "site-packages"])
def test_writes_outside_the_sandbox_do_not_reach_the_host(sandbox, directory, refusals):
    target = Path(directory) / f"raytool-escape-{id(sandbox)}.py"
    try:
        r = sandbox.run(f"open({str(target)!r}, 'w').write('escaped')\nprint('written')")
        assert not target.exists(), f"the cell wrote {target} on the host"
    finally:
        target.unlink(missing_ok=True)
    if refusals:
        assert r.status == "error" and any(refusal in r.stderr for refusal in refusals), r
    else:
        assert (r.status, r.stdout) == ("ok", "written\n"), r
    sandbox.assert_serves_a_normal_cell()


# -- processes and privileges -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["os.getppid()", "1"])
def test_killing_the_parent_is_refused(sandbox, target):
    assert sandbox.run("state = 'kept'", session="parent").status == "ok"
    r = sandbox.run(f"import os\nos.kill({target}, 9)", session="parent")
    assert r.status == "error" and "PermissionError" in r.stderr, r  # another uid's process, in both modes
    kept = sandbox.run("print(state)", session="parent")
    assert (kept.status, kept.stdout) == ("ok", "kept\n"), kept
    sandbox.close_session("parent")
    sandbox.assert_serves_a_normal_cell()


@pytest.mark.parametrize("target", ["-1", "SENTINEL"])
def test_signals_do_not_reach_host_processes(sandbox, sentinel, target):
    r = sandbox.run(f"import os\nos.kill({target.replace('SENTINEL', str(sentinel.pid))}, 9)")
    assert r.status == "error" and "ProcessLookupError" in r.stderr, r  # nothing it may signal is visible
    assert sentinel.poll() is None, "the host's sentinel process was killed"
    sandbox.assert_serves_a_normal_cell()


def test_setuid_root_is_refused(sandbox):
    r = sandbox.run("import os\nprint(os.getuid())\nos.setuid(0)")
    assert r.status == "error" and "PermissionError" in r.stderr, r
    assert int(r.stdout) != 0
    sandbox.assert_serves_a_normal_cell()


def test_cells_hold_no_capabilities(sandbox):
    r = sandbox.run("print(*[line.split()[1] for line in open('/proc/self/status') if line.startswith(('CapPrm', 'CapEff'))])")
    assert (r.status, r.stdout) == ("ok", "0000000000000000 0000000000000000\n"), r
    sandbox.assert_serves_a_normal_cell()


MS_BIND, MS_REMOUNT = 4096, 32
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000


@pytest.mark.parametrize("call", [
    "libc.mount(b'tmpfs', b'/sandbox', b'tmpfs', 0, None)",
    f"libc.mount(None, b'/', None, {MS_REMOUNT | MS_BIND}, None)",  # make the root writable
    f"libc.unshare({CLONE_NEWNS})",
    f"libc.unshare({CLONE_NEWNET})",
    f"libc.unshare({CLONE_NEWUSER})",  # a user namespace would make every other call here succeed
], ids=["mount-tmpfs", "remount-root-rw", "unshare-mount", "unshare-net", "unshare-user"])
def test_mount_and_unshare_are_refused(sandbox, call):
    r = sandbox.run(cell(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if {call} != 0:
            raise OSError(ctypes.get_errno(), 'refused')
        print('allowed')
    """))
    assert r.status == "error" and f"[Errno {errno.EPERM}] refused" in r.stderr, r
    sandbox.assert_serves_a_normal_cell()


@pytest.mark.parametrize("code, marker", [
    (f"import subprocess\nsubprocess.Popen({MARKERS['orphan']})", MARKERS["orphan"]),
    (cell(f"""
        import os, subprocess
        middle = os.fork()
        if middle == 0:
            subprocess.Popen({MARKERS['daemon']}, start_new_session=True)  # setsid, then exec
            os._exit(0)
        os.waitpid(middle, 0)
    """), MARKERS["daemon"]),
], ids=["popen-orphan", "setsid-double-fork-daemon"])
def test_processes_left_behind_die_with_the_cell(sandbox, code, marker):
    r = sandbox.run(code + "\nprint('left behind')")
    assert (r.status, r.stdout) == ("ok", "left behind\n"), r
    assert sandbox.wait_until(lambda: not processes_running(marker)), f"{' '.join(marker)} outlived its cell"
    sandbox.assert_serves_a_normal_cell()


def test_a_sessions_processes_die_when_it_is_closed(sandbox):
    marker = MARKERS["session"]
    r = sandbox.run(f"import subprocess\nsubprocess.Popen({marker}, start_new_session=True)\nprint('started')", session="procs")
    assert (r.status, r.stdout) == ("ok", "started\n"), r
    assert sandbox.wait_until(lambda: processes_running(marker)), "the session's process should run while the session lives"
    sandbox.close_session("procs")
    assert sandbox.wait_until(lambda: not processes_running(marker)), f"{' '.join(marker)} outlived its session"
    sandbox.assert_serves_a_normal_cell()


def test_a_forked_child_does_not_answer_for_the_next_cell(sandbox):
    """A child that is not told to exit finishes the cell as a second runner; its reply must not be
    taken for the answer to the session's next cell."""
    r = sandbox.run(cell("""
        import os, time
        if os.fork() != 0:  # the child runs off the end of the cell at once, silently
            time.sleep(0.5)
            print('parent')
    """), session="forked")
    assert (r.status, r.stdout) == ("ok", "parent\n"), r
    results = [sandbox.run(f"print({i})", session="forked") for i in range(3)]
    sandbox.close_session("forked")
    assert [(x.status, x.stdout) for x in results] == [("ok", f"{i}\n") for i in range(3)], results
    sandbox.assert_serves_a_normal_cell()


# -- isolation between sessions -------------------------------------------------------------------------


def test_sessions_do_not_share_variables(sandbox):
    assert sandbox.run("secret = 'alpha'", session="a").status == "ok"
    r = sandbox.run("print(secret)", session="b")
    assert r.status == "error" and "NameError: name 'secret' is not defined" in r.stderr, r
    own = sandbox.run("print(secret)", session="a")
    assert (own.status, own.stdout) == ("ok", "alpha\n")
    sandbox.close_session("a")
    sandbox.close_session("b")
    sandbox.assert_serves_a_normal_cell()


def test_sessions_do_not_share_files(sandbox):
    assert sandbox.run("open('/sandbox/note.txt', 'w').write('from a')", session="a").status == "ok"
    r = sandbox.run("import os\nprint(os.listdir('/sandbox'))\nopen('/sandbox/note.txt')", session="b")
    assert r.status == "error" and "FileNotFoundError" in r.stderr and r.stdout == "[]\n", r
    own = sandbox.run("print(open('/sandbox/note.txt').read())", session="a")
    assert (own.status, own.stdout) == ("ok", "from a\n")
    sandbox.close_session("a")
    sandbox.close_session("b")
    sandbox.assert_serves_a_normal_cell()


def test_sessions_do_not_see_each_others_processes(sandbox):
    marker = MARKERS["neighbour"]
    assert sandbox.run(f"import subprocess\np = subprocess.Popen({marker})", session="a").status == "ok"
    r = sandbox.run(cell("""
        import os
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                print(open(f'/proc/{pid}/cmdline', 'rb').read())
    """), session="b")
    assert r.status == "ok" and "sleep" not in r.stdout and "python" in r.stdout, r
    assert sandbox.wait_until(lambda: processes_running(marker)), "session a's process should be running on the host"
    sandbox.close_session("a")
    sandbox.close_session("b")
    assert sandbox.wait_until(lambda: not processes_running(marker))
    sandbox.assert_serves_a_normal_cell()


SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def check(ret):
    if ret == -1 or ret == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), 'System V shared memory')
    return ret
"""


def test_shared_memory_does_not_outlive_its_session(sandbox):
    """System V segments live in the IPC namespace, not in a process: a session must not leave one
    behind for the next session to read."""
    r = sandbox.run(SHM + cell("""
        shmid = check(libc.shmget(0x5EC2E7, 1 << 20, 0o1666))  # IPC_CREAT, readable by every uid
        addr = check(libc.shmat(shmid, None, 0))
        ctypes.memmove(addr, b'left by an earlier session', 26)
        print('parked')
    """))
    assert (r.status, r.stdout) == ("ok", "parked\n"), r
    later = sandbox.run(SHM + "addr = check(libc.shmat(check(libc.shmget(0x5EC2E7, 0, 0)), None, 0))\nprint(ctypes.string_at(addr, 26))")
    assert later.status == "error" and f"[Errno {errno.ENOENT}]" in later.stderr, later
    assert "left by an earlier session" not in later.stdout
    sandbox.assert_serves_a_normal_cell()


def test_shared_memory_does_not_carry_memory_past_the_limit(sandbox):
    """Memory touched in a segment and detached stays resident; it must go when the session ends."""
    count_parked = "keys = range(0x7000, 0x7003)\nprint(sum(int(line.split()[0]) in keys for line in open('/proc/sysvipc/shm').readlines()[1:]))"
    r = sandbox.run(SHM + cell("""
        for key in range(0x7000, 0x7003):  # 3 x 200 MB, each touched and detached: past the 256 MB limit
            shmid = check(libc.shmget(key, 200 << 20, 0o1600))
            addr = check(libc.shmat(shmid, None, 0))
            ctypes.memset(addr, 1, 200 << 20)
            check(libc.shmdt(ctypes.c_void_p(addr)))
    """) + "\n" + count_parked, timeout_s=5)
    assert (r.status, r.stdout) == ("ok", "3\n"), r
    later = sandbox.run(count_parked)
    assert (later.status, later.stdout) == ("ok", "0\n"), f"segments of an ended session are still resident: {later}"
    sandbox.assert_serves_a_normal_cell()


def test_sessions_cannot_talk_over_abstract_unix_sockets(sandbox):
    """Abstract socket names live in the network namespace, not the file system."""
    r = sandbox.run("import socket\nlistener = socket.socket(socket.AF_UNIX)\nlistener.bind('\\0raytool-covert')\nlistener.listen()", session="a")
    assert r.status == "ok", r
    other = sandbox.run("import socket\nsocket.socket(socket.AF_UNIX).connect('\\0raytool-covert')", session="b")
    sandbox.close_session("a")
    sandbox.close_session("b")
    assert other.status == "error" and "ConnectionRefusedError" in other.stderr, other
    sandbox.assert_serves_a_normal_cell()


def test_fresh_cells_share_nothing(sandbox):
    assert sandbox.run("x = 1\nopen('mine.txt', 'w').write('x')").status == "ok"
    r = sandbox.run("import os\nprint(os.listdir('.'))\nx")
    assert r.status == "error" and "NameError" in r.stderr and r.stdout == "[]\n", r
    sandbox.assert_serves_a_normal_cell()


# -- last: shutting down -------------------------------------------------------------------------------


def test_aclose_leaves_no_process_and_no_directory(sandbox, private_tmp):
    assert sandbox.backend.stats()["zygote_starts"] == 1, "a hostile cell brought the fork-server down"
    assert our_zygote_processes(), "the fork-server should be running before aclose"
    sandbox.loop.run_until_complete(sandbox.backend.aclose())
    assert sandbox.wait_until(lambda: not our_zygote_processes()), f"left running after aclose: {our_zygote_processes()}"
    for marker in MARKERS.values():
        assert not processes_running(marker), f"{' '.join(marker)} is still running"
    leftovers = sorted(p.name for p in private_tmp.iterdir() if p.name.startswith(("raytool-sandbox-", "raytool-cell-")))
    assert leftovers == [], f"aclose left temp dirs behind: {leftovers}"
