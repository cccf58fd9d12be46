"""What hardware a process has: its accelerator (torch device, distributed backend, Ray resource
name), whether its CPU computes bf16 / fp16 natively, and the dtypes and preloads that follow."""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" | "npu" | "cpu"
    ray_resource: str | None  # "GPU" | "NPU" | None

    @property
    def process_group_backend(self) -> str:
        """The trainer's process group: the accelerator's backend for its tensors and gloo for CPU
        tensors (offloaded parameters and gradients, host-side metrics), which NCCL and HCCL
        cannot reduce."""
        return process_group_backend(self.kind)


def process_group_backend(kind: str) -> str:
    """"gloo" on CPUs; "cpu:gloo,cuda:nccl" / "cpu:gloo,npu:hccl" on accelerators."""
    accelerator = {"cuda": "nccl", "npu": "hccl"}.get(kind)
    return f"cpu:gloo,{kind}:{accelerator}" if accelerator else "gloo"


def accelerator_memory(device) -> float:
    """Total memory of the accelerator `device` (a torch.device) in bytes; 0 on a CPU."""
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "npu":
        return float(torch.npu.get_device_properties(device).total_memory)
    return 0.0


def detect() -> DeviceInfo:
    import torch

    if torch.cuda.is_available():
        return DeviceInfo("cuda", "GPU")
    if importlib_has("torch_npu"):
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return DeviceInfo("npu", "NPU")
    return DeviceInfo("cpu", None)


def importlib_has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def unreachable_gloo_address(env: dict | None = None) -> str | None:
    """Why this host's gloo endpoint would be unreachable from other hosts (None: it would not be).
    Without GLOO_SOCKET_IFNAME gloo binds the address the host name resolves to, which on stock
    Ubuntu hosts is 127.0.1.1 (/etc/hosts): the other hosts' ranks then cannot connect, and the
    process group hangs until its timeout. NCCL picks a non-loopback interface by itself."""
    import ipaddress
    import socket

    env = os.environ if env is None else env
    interface = env.get("GLOO_SOCKET_IFNAME", "")
    if interface:
        return f"GLOO_SOCKET_IFNAME={interface} is the loopback interface" if interface.split(",")[0] == "lo" else None
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        return f"host name {host} does not resolve ({exc})"
    if ipaddress.ip_address(address).is_loopback:
        return f"host name {host} resolves to {address}, a loopback address"
    return None


def torch_threads(threads: int, num_cpus: float, num_accelerators: float) -> int:
    """Intra-op threads of an engine or trainer process: `threads` (cluster.torch_threads) when set;
    0: on an accelerator the Ray CPUs the actor reserves (a node's 8 trainer ranks would otherwise
    each take all its cores and contend in the host-side optimizer step), on a CPU every core the
    process may run on (the engine and the trainer compute in turn, not at once)."""
    if threads:
        return threads
    if num_accelerators and num_cpus >= 1:
        return int(num_cpus)
    return len(os.sched_getaffinity(0))


def set_torch_threads(threads: int) -> int:
    """Use `threads` intra-op threads (`torch_threads` decides them; 0: every core this process may
    run on); return the count."""
    import torch

    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def _cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo text (x86 `flags`, Arm `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.lru_cache(maxsize=1)
def _this_cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags, read once per process (None: no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(_cpu_flags(f.read()))
    except OSError:
        return None


def cpu_bf16_support(cpuinfo: str | None = None) -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16), and what said so.

    Elsewhere PyTorch emulates bf16 matmuls, far slower than fp32 (measured with 2 threads on an
    AVX2 AMD EPYC: 1 vs 120 GFLOP/s; on an AVX512-BF16 one bf16 was the faster: 990 vs 215).
    torch's own probe says yes for AVX512-BF16; otherwise the flags of /proc/cpuinfo (or `cpuinfo`,
    for tests) decide."""
    import platform

    import torch

    if cpuinfo is None:
        if torch.cpu._is_avx512_bf16_supported():
            return True, "avx512_bf16"
        flags = _this_cpu_flags()
        if flags is None:
            return False, "unknown CPU (no /proc/cpuinfo)"
    else:
        flags = _cpu_flags(cpuinfo)
    for flag in ("avx512_bf16", "amx_bf16", "bf16"):  # x86 flags, then Arm's feature name
        if flag in flags:
            return True, flag
    x86 = platform.machine() in ("x86_64", "AMD64")
    return False, "no avx512_bf16, amx_bf16 or bf16 CPU flag" + (f" (torch: {torch.backends.cpu.get_cpu_capability()})" if x86 else "")


_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def cpu_preloads() -> list[str]:
    """Libraries vLLM's CPU worker wants preloaded (LD_PRELOAD) that this machine has: tcmalloc
    (Debian's libtcmalloc-minimal4) and, on x86, Intel OpenMP (PyPI's intel-openmp, in
    sys.prefix/lib). Empty where neither is installed."""
    import platform
    import sys

    found = []
    tcmalloc = next((os.path.join(d, n) for n in _TCMALLOC for d in _LIB_DIRS if os.path.exists(os.path.join(d, n))), None)
    if tcmalloc:
        found.append(tcmalloc)
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if platform.machine() in ("x86_64", "AMD64") and os.path.exists(iomp):
        found.append(iomp)
    return found


_PRELOAD_KINDS = {"allocator": ("tcmalloc", "jemalloc", "mimalloc"), "openmp": ("gomp", "iomp", "libomp")}
NO_FAST_ALLOCATOR = ("vLLM on CPU without tcmalloc: decoding is about 18% slower (`raytool bench engine`); install it with "
                     "`apt-get install libtcmalloc-minimal4` (scripts/setup.sh does as root)")


def fast_allocator_missing(ld_preload: str | None = None, found: list[str] | None = None) -> bool:
    """Neither this machine (`found`, else cpu_preloads()) nor LD_PRELOAD has a fast allocator for vLLM's CPU engine."""
    preloaded = (os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload).split(":")
    found = cpu_preloads() if found is None else found
    return not any(name in lib for lib in found + preloaded for name in _PRELOAD_KINDS["allocator"])


def with_preloads(ld_preload: str, libraries: list[str]) -> str:
    """`ld_preload` (an LD_PRELOAD value) with `libraries` put in front, one allocator and one OpenMP
    runtime at most: a kind already there is the user's choice and stays the only one."""
    def kind(path: str) -> str:
        name = os.path.basename(path)
        return next((k for k, names in _PRELOAD_KINDS.items() if any(n in name for n in names)), name)

    current = [p for p in re.split(r"[: ]", ld_preload) if p]
    taken = {kind(p) for p in current}
    return ":".join([*(p for p in libraries if kind(p) not in taken), *current])


def cpu_fp16_support(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes fp16 natively (x86 AVX512-FP16 or AMX-FP16, Arm FP16 SIMD)."""
    flags = (_this_cpu_flags() or frozenset()) if cpuinfo is None else _cpu_flags(cpuinfo)
    return bool(flags & {"avx512_fp16", "amx_fp16", "asimdhp"})


def engine_dtype(name: str, on_accelerator: bool, engine: str = "vllm") -> tuple[str, str]:
    """The rollout engine's weight dtype for `model.dtype` (`name`) and why. auto: bfloat16 on
    GPUs/NPUs and on CPUs with native bf16, float32 on other CPUs. There, bf16 and fp16 are
    emulated (SmolLM2-135M on 2 AVX2 cores: fp32 93, bf16 28, fp16 38 tokens/s in `raytool bench
    engine`): allowed with a one-line warning. A dtype vLLM's CPU platform does not list is refused
    with a ValueError naming `model.dtype`."""
    if on_accelerator:
        return ("bfloat16", "accelerator") if name == "auto" else (name, "set")
    native_bf16, why = cpu_bf16_support()
    if name == "auto":
        return ("bfloat16", f"CPU with native bf16: {why}") if native_bf16 else ("float32", f"CPU without native bf16: {why}")
    if engine == "vllm":
        try:
            from vllm.platforms import current_platform
        except ImportError:
            current_platform = None
        supported = [str(d).removeprefix("torch.") for d in getattr(current_platform, "supported_dtypes", [])]
        if current_platform is not None and current_platform.is_cpu() and name not in supported:
            raise ValueError(f"config key 'model.dtype': vLLM cannot run {name} on this CPU (it runs {', '.join(supported)}); "
                             "use auto or one of those")
    emulated = (name == "bfloat16" and not native_bf16) or (name == "float16" and not cpu_fp16_support())
    if emulated:
        log.warning(
            "config key 'model.dtype' is %s, but this CPU has no native %s (%s): the engine emulates it, several times "
            "slower than float32 (auto would pick float32 here)", name, name, why if name == "bfloat16" else "no fp16 flag")
    return name, "set"
