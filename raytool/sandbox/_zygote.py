"""The local sandbox's fork-server ("zygote"): a warm, walled-in interpreter that forks sessions.

Run as a script (`python -I _zygote.py CONFIG_JSON`) by `raytool.sandbox.local.LocalBackend`; it
imports only the standard library plus the modules it preloads, never raytool.

Isolation is entered once, here, and every session inherits it at no per-cell cost:
- new network, IPC and UTS namespaces: no network at all (only a loopback that is down);
- a new mount namespace whose root is a read-only tmpfs holding read-only binds of what Python
  needs (/usr, the lib dirs, the interpreter's prefixes and sys.path) and a handful of /etc and /dev
  entries; nothing else of the host is visible (home directories, /tmp, Ray's session dir and
  auth token, SSH keys). `pivot_root` drops the old root.
When the kernel refuses namespaces as root, a user namespace is tried; when that is refused too,
the zygote runs without them and says so in its hello message (the backend logs it once).

Per session the zygote forks a supervisor C that enters a new PID and mount namespace, mounts a
private size-limited tmpfs at /sandbox, and forks G, PID 1 of that namespace: G mounts /proc (so
only the session's own processes are visible), reaps orphans, and forks U, which drops to the
session's own unprivileged uid, sets rlimits and runs cells. When G dies the kernel kills every
process in the namespace, setsid'd or not; G dies with C (parent-death signal), and the backend
kills C's process group through the zygote. So a session ends completely, whatever its code did.

Protocol. Backend -> zygote on the command socket: one JSON message per `sendmsg`, with file
descriptors attached for `spawn`. Zygote -> backend: JSON lines on stdout (`hello`, `spawned`,
`exit`). Backend <-> U on the session's control socket: JSON lines (`ready`, then per cell a
request `{"code", "cpu_s"}` and a reply `{"done", "error", "exit_code"}`); the cell's stdout and
stderr go to two pipes the backend reads directly.
"""

import ast
import builtins
import ctypes
import errno
import importlib
import json
import linecache
import os
import random
import resource
import select
import signal
import socket
import sys
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: s.encode() if isinstance(s, str) else s  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), "prctl")


# What a cell may not do however it asks: make namespaces (unprivileged user namespaces are on by
# default, and in one a cell holds every capability over new mount, network and PID namespaces: a
# large kernel surface for no use). A seccomp filter, since no rlimit or uid can say it.
SECCOMP_ABI = {"x86_64": (0xC000003E, 272, 56), "aarch64": (0xC00000B7, 97, 220)}.get(os.uname().machine)  # (arch, unshare, clone)
SYS_CLONE3 = 435
NS_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | 0x02000000 | 0x80  # + cgroup, time


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def forbid_namespaces() -> None:
    """seccomp: unshare/clone with a namespace flag fail with EPERM, clone3 (its flags are out of a
    filter's reach) with ENOSYS so libc falls back to clone, and a foreign syscall ABI gets EPERM."""
    arch, nr_unshare, nr_clone = SECCOMP_ABI
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    prog = [
        (LD, 0, 0, 4),  # 0: seccomp_data.arch
        (JEQ, 1, 0, arch),  # 1: -> 3
        (RET, 0, 0, eperm),  # 2
        (LD, 0, 0, 0),  # 3: seccomp_data.nr
        (JGE, 6, 0, 0x40000000),  # 4: the x32 ABI -> 11
        (JEQ, 6, 0, SYS_CLONE3),  # 5: -> 12
        (JEQ, 1, 0, nr_unshare),  # 6: -> 8
        (JEQ, 0, 2, nr_clone),  # 7: -> 8, else -> 10
        (LD, 0, 0, 16),  # 8: seccomp_data.args[0], low 32 bits
        (JSET, 1, 0, NS_FLAGS),  # 9: -> 11
        (RET, 0, 0, allow),  # 10
        (RET, 0, 0, eperm),  # 11
        (RET, 0, 0, enosys),  # 12
    ]
    fprog = _SockFprog(len(prog), (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog]))
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Empty our capability sets (the creator of a user namespace holds all of them in it)."""
    _LINUX_CAPABILITY_VERSION_3 = 0x20080522
    _check(_libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), (_CapData * 2)()), "capset")


def die_with_parent(expected_parent: int) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected_parent:  # the parent died before the signal was armed
        os._exit(137)


# -- isolation, entered once ---------------------------------------------------------------------

ETC_FILES = ["ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf", "hosts", "mime.types"]
DEV_FILES = ["null", "zero", "full", "random", "urandom"]


def _mount_flags_of(path: str) -> int:
    """The flags a read-only remount must keep (a user namespace may not clear locked ones)."""
    f = os.statvfs(path).f_flag
    keep = [(os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (getattr(os, "ST_RELATIME", 4096), MS_RELATIME)]
    return sum(ms for st, ms in keep if f & st)


def _bind_ro(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _mount_flags_of(dst))


def _python_paths() -> list[str]:
    """The interpreter's prefixes and package dirs, without ones already under another.

    Only installed packages: a source checkout on sys.path (an editable install, a job's working
    dir) is the host's, not the cell's, and stays out of view.
    """
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    packages = [p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
    paths = {os.path.realpath(p) for p in prefixes + packages if p and os.path.isdir(p)}
    out = []
    for p in sorted(paths):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def build_root(root: str, keep_proc: bool) -> None:
    """Make `root` a read-only world of what Python needs, then pivot into it.

    `keep_proc`: bind the host's /proc in (a user namespace may only mount a session's own /proc
    where a full one is visible); every session mounts its own over it.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for top in ["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"]:
        host = "/" + top
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, top))
        elif os.path.isdir(host):
            _bind_ro(host, os.path.join(root, top))
    for p in _python_paths():
        if not p.startswith("/usr/") and p != "/usr":
            _bind_ro(p, root + p)
    os.makedirs(os.path.join(root, "etc"))
    for name in ETC_FILES:
        if os.path.exists("/etc/" + name):
            _bind_ro(os.path.realpath("/etc/" + name), os.path.join(root, "etc", name))
    os.makedirs(os.path.join(root, "dev"))
    for name in DEV_FILES:
        open(os.path.join(root, "dev", name), "w").close()
        mount("/dev/" + name, os.path.join(root, "dev", name), None, MS_BIND)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, os.path.join(root, "dev", name))
    for d in ["proc", "sandbox", ".old"]:
        os.makedirs(os.path.join(root, d))
    if keep_proc:
        mount("/proc", os.path.join(root, "proc"), None, MS_BIND | MS_REC)
    # /tmp is the session's own /sandbox, except when the interpreter itself is installed under
    # /tmp (a CI checkout): then /tmp is the read-only view holding it, and TMPDIR still says /sandbox.
    if not os.path.exists(os.path.join(root, "tmp")):
        os.symlink("/sandbox", os.path.join(root, "tmp"))
    if SYS_PIVOT_ROOT is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(_libc.syscall(SYS_PIVOT_ROOT, root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _map_ids(inside: int, outside_uid: int, outside_gid: int) -> None:
    """Map one uid/gid of a fresh user namespace to ours outside it."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside} {outside_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside} {outside_gid} 1")


SESSION_UID_BASE, SESSION_UIDS = 1000, 65536  # inside a user namespace: the uids sessions run as


def _range_mapper(target: int, uid: int, gid: int):
    """Fork a helper that stays in our user namespace and, once `target` has entered a new one,
    maps there 0 to us and SESSION_UIDS uids from SESSION_UID_BASE to unused host uids."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        if os.read(r, 1) != b"g":
            os._exit(1)
        host = random.randrange(1 << 20, (1 << 30) - SESSION_UIDS)
        try:
            for kind, own in (("uid", uid), ("gid", gid)):
                with open(f"/proc/{target}/{kind}_map", "w") as f:
                    f.write(f"0 {own} 1\n{SESSION_UID_BASE} {host} {SESSION_UIDS}\n")
        except OSError:
            os._exit(1)
        os._exit(0)
    os.close(r)
    return pid, w


def _finish_range_mapper(helper, go: bool) -> bool:
    """Let the helper write the maps (or dismiss it); True if it did."""
    if helper is None:
        return False
    pid, w = helper
    os.write(w, b"g" if go else b"x")
    os.close(w)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and go


def session_uid(spec: dict, caps: dict) -> int:
    """The uid a session's cells run as (inside our user namespace, if we are in one)."""
    if caps.get("uid_range"):
        base, count = caps["uid_range"]
        return base + spec["uid"] % count
    return spec["uid"]


def enter_namespaces(root: str, notes: list[str], force_userns: bool = False) -> dict:
    """Isolate this process as far as the kernel allows; returns what was achieved."""
    caps = {"userns": False, "netns": False, "mountns": False, "pidns": False, "proc": False, "setuid": os.geteuid() == 0}
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        if force_userns:
            raise PermissionError(errno.EPERM, "a user namespace was asked for")
        unshare(flags)
    except OSError as exc:
        uid, gid = os.geteuid(), os.getegid()
        # Root may map a range of unprivileged host uids too (from a helper left outside the
        # namespace): sessions then get uids of their own, as without a user namespace.
        helper = _range_mapper(os.getpid(), uid, gid) if uid == 0 else None
        try:
            unshare(flags | CLONE_NEWUSER)
        except OSError as exc2:
            _finish_range_mapper(helper, go=False)
            notes.append(f"the kernel refused new namespaces ({exc}; with a user namespace: {exc2}): cells keep the host's network and file system view")
            return caps
        try:
            if _finish_range_mapper(helper, go=True):
                caps.update(userns=True, setuid=True, uid_range=[SESSION_UID_BASE, SESSION_UIDS])
            else:
                _map_ids(0, uid, gid)
                caps.update(userns=True, setuid=False)
                notes.append("not root: isolation runs in a user namespace; all sessions share one uid, so the process limit is shared")
        except OSError as exc2:
            notes.append(f"the kernel refused to map our uid into a user namespace ({exc2}): cells keep the host's file system view, without network")
            caps["netns"] = True
            return caps
    caps["netns"] = True
    try:
        build_root(root, keep_proc=caps["userns"])
        caps["mountns"] = True
    except OSError as exc:
        notes.append(f"could not build the read-only file system view ({exc}): cells see the host's files")
    caps["pidns"], caps["proc"] = _probe_pid_namespace(caps["mountns"])
    if not caps["pidns"]:
        notes.append("the kernel refused PID namespaces: a session's processes are killed by process group, so one that calls setsid() can outlive it")
    elif caps["mountns"] and not caps["proc"]:
        notes.append("the kernel refused to mount a session's own /proc (a user namespace needs a fully visible /proc): cells run without /proc")
    return caps


def _probe_pid_namespace(mountns: bool) -> tuple[bool, bool]:
    """May a session enter a PID namespace, and mount its own /proc there? (tried in a child)"""
    pid = os.fork()
    if pid == 0:
        try:
            unshare(CLONE_NEWPID | (CLONE_NEWNS if mountns else 0))
        except OSError:
            os._exit(1)
        inner = os.fork()
        if inner == 0:
            try:
                if mountns:
                    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                os._exit(0)
            except OSError:
                os._exit(2)
        os._exit(os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1]))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return code != 1, code == 0 and mountns


# -- the cell runner (U) -------------------------------------------------------------------------

class CellRunner:
    """Runs cells in one namespace the way a notebook does: a trailing expression's value is shown."""

    def __init__(self):
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.count = 0

    def run(self, code: str) -> tuple[str | None, int | None]:
        """Run one cell; returns (exception type name or None, exit code if it called sys.exit)."""
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.namespace)
                if value is not None:
                    self.namespace["_"] = value
                    print(repr(value))
            return None, None
        except SystemExit as exc:
            code_ = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
            return (None if code_ == 0 else "SystemExit"), code_
        except BaseException as exc:  # the cell's own error: shown to the model, the session goes on
            # Hide the runner's frames: a SyntaxError carries its own location, others start in the cell.
            tb = None if isinstance(exc, SyntaxError) else exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            traceback.print_exception(type(exc), exc, tb)
            return type(exc).__name__, None
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:
                pass
            _libc.fflush(None)


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _lines(sock: socket.socket):
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield json.loads(line)


def run_cells(ctrl: socket.socket, spec: dict, caps: dict) -> None:
    """U: become the session's unprivileged user, set limits, then serve cells until EOF."""
    lim = spec["limits"]
    if caps["setuid"]:
        uid = session_uid(spec, caps)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif caps["userns"]:
        # We are root of the user namespace that owns our mounts, so we could remount them
        # writable. A nested user namespace, where we are not root, leaves us no say over them.
        outside_uid, outside_gid = os.geteuid(), os.getegid()
        unshare(CLONE_NEWUSER)
        _map_ids(1000, outside_uid, outside_gid)
        drop_capabilities()  # uid 1000 here, but still holding every capability in this namespace
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if SECCOMP_ABI is not None:
        forbid_namespaces()
    as_bytes = spec["base_vm"] + (lim["memory_mb"] << 20)  # the preloaded interpreter plus the cell's share
    resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    # RLIMIT_NPROC counts every process of the uid: exact with a uid of our own, approximate
    # (the uid's other processes at start plus the limit) when sessions share the host user's uid.
    nproc = lim["max_processes"] + (0 if caps["setuid"] else spec["host_procs"])
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["disk_mb"] << 20, lim["disk_mb"] << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["workdir"])
    runner = CellRunner()
    me = os.getpid()
    _send(ctrl, {"ready": True, "pid": me, "caps": caps})
    for msg in _lines(ctrl):
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime + msg["cpu_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        error, exit_code = runner.run(msg["code"])
        if os.getpid() != me:  # a child the cell forked ran off the cell's end: only U answers
            os._exit(exit_code if exit_code is not None else 0 if error is None else 1)
        _send(ctrl, {"done": True, "error": error, "exit_code": exit_code})
    os._exit(0)


def session_main(fds: list[int], spec: dict, caps: dict, zygote_pid: int) -> None:
    """C: enter the session's PID and mount namespaces, then supervise G (which forks U)."""
    ctrl_fd, out_fd, err_fd = fds
    os.setsid()
    die_with_parent(zygote_pid)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)  # the zygote's event stream is not ours to write to
    os.close(null)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    if caps["pidns"]:
        # IPC and network too: System V segments and abstract socket names live in those
        # namespaces, not in a process, so shared ones outlive a session and join sessions.
        unshare(CLONE_NEWPID | (CLONE_NEWNS if caps["mountns"] else 0) | (CLONE_NEWIPC | CLONE_NEWNET if caps["netns"] else 0))
    if caps["mountns"]:
        owner = f",uid={session_uid(spec, caps)},gid={session_uid(spec, caps)}" if caps["setuid"] else ""
        mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['limits']['disk_mb']}m,mode=0700{owner}")
        spec["workdir"] = "/sandbox"
    else:
        os.chown(spec["workdir"], spec["uid"], spec["uid"]) if caps["setuid"] else None
    me = os.getpid()
    g = os.fork()
    if g == 0:
        die_with_parent(0 if caps["pidns"] else me)  # a parent outside our PID namespace shows as 0
        if caps["proc"]:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif caps["userns"] and caps["mountns"]:
            _check(_libc.umount2(b"/proc", MNT_DETACH), "umount the host's /proc")  # never the host's
        g_pid = os.getpid()
        u = os.fork()
        if u == 0:
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.closerange(3, ctrl_fd)
            os.closerange(ctrl_fd + 1, 1 << 16)
            if not caps["pidns"]:
                die_with_parent(g_pid)
            try:
                run_cells(socket.socket(fileno=ctrl_fd), spec, caps)
            except BaseException:
                traceback.print_exc()
                os._exit(70)
        os.close(ctrl_fd)
        while True:  # G: reap everything; leave (killing the namespace) when U is gone
            pid, status = os.wait()
            if pid == u:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(g, 0)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


# -- the zygote's loop ---------------------------------------------------------------------------

def emit(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


# Importing sympy loads little; its first factor/solve/simplify pull in the polys, solvers and
# simplify packages (~30 ms per fresh process). Running them once here makes every cell start warm.
WARMUP = {
    "sympy": "x = sympy.Symbol('x'); sympy.factor(x**2 - 1); sympy.solve(x**2 - 2, x); sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2);"
             " sympy.integrate(x**2, x); sympy.nsimplify(0.5); sympy.Rational(1, 3) + 1; sympy.expand((x + 1)**3); sympy.N(sympy.pi, 20)",
    "numpy": "numpy.linalg.solve(numpy.eye(2), numpy.ones(2)); numpy.random.default_rng(0).random(3)",
}


def preload(modules: list[str], notes: list[str]) -> None:
    for name in modules:
        try:
            module = importlib.import_module(name)
            if name in WARMUP:
                exec(WARMUP[name], {name: module})
        except Exception as exc:  # a missing optional module is not fatal
            notes.append(f"could not preload {name}: {exc!r}")


def _owner(pid: str) -> int:
    try:
        return os.stat("/proc/" + pid).st_uid
    except OSError:
        return -1


def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent(cfg["parent_pid"])
    cmd = socket.socket(fileno=cfg["cmd_fd"])
    notes: list[str] = []
    preload(cfg["preload"], notes)
    uid = os.getuid()
    host_procs = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
    with open("/proc/self/statm") as f:
        base_vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    caps = enter_namespaces(cfg["root"], notes, cfg.get("force_userns", False)) if cfg["isolate"] else {"userns": False, "netns": False, "mountns": False, "pidns": False, "proc": False, "setuid": os.geteuid() == 0}
    if not cfg["isolate"]:
        notes.append("isolation switched off by config (sandbox.isolate=false)")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    emit({"event": "hello", "pid": os.getpid(), "caps": caps, "notes": notes})
    children: set[int] = set()
    me = os.getpid()
    while True:
        ready, _, _ = select.select([cmd, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in children:
                    children.discard(pid)
                    try:  # stragglers of its process group (only matters without a PID namespace)
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    emit({"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if cmd in ready:
            try:
                data, fds, _, _ = socket.recv_fds(cmd, 1 << 16, 3)
            except ConnectionResetError:
                data, fds = b"", []
            if not data:  # the backend is gone: take every session down with us
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                os._exit(0)
            msg = json.loads(data)
            if msg["op"] == "spawn":
                msg.update(host_procs=host_procs, base_vm=base_vm)
                pid = os.fork()
                if pid == 0:
                    try:
                        cmd.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        session_main(fds, msg, caps, me)
                    except BaseException:
                        traceback.print_exc()
                    os._exit(71)
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                emit({"event": "spawned", "id": msg["id"], "pid": pid})
            elif msg["op"] == "kill" and msg["pid"] in children:
                try:
                    os.killpg(msg["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


if __name__ == "__main__":
    main()
