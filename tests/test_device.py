"""Which dtypes a CPU gets: native bf16 detection, the trainer's and the engine's `auto`, and the
one-line warnings and refusals for dtypes a CPU would emulate or cannot run."""

import time
import logging

import pytest
import torch

from raytool import device
from raytool.training import trainer as trainer_module

# /proc/cpuinfo excerpts of real machines (flags shortened to the ones that matter, order kept).
EPYC_MILAN = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu sse sse2 avx fma avx2 bmi2\n"
EPYC_GENOA = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
SKYLAKE_SP = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512vl avx512dq\n"  # AVX-512, but bf16 only emulated
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm svebf16\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize("cpuinfo, native, reason", [
    (EPYC_MILAN, False, "no avx512_bf16"), (SKYLAKE_SP, False, "no avx512_bf16"), (GRAVITON2, False, "no avx512_bf16"),
    (EPYC_GENOA, True, "avx512_bf16"), (SAPPHIRE_RAPIDS, True, "avx512_bf16"), (GRAVITON3, True, "bf16"),
])
def test_native_bf16_is_read_off_the_cpu_flags(cpuinfo, native, reason):
    got, why = device.cpu_bf16_support(cpuinfo)
    assert got is native and why.startswith(reason)
    assert device.cpu_fp16_support(cpuinfo) is False


def test_this_machine_agrees_with_its_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = device._cpu_flags(f.read())
    native, why = device.cpu_bf16_support()
    assert native == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}), why


@pytest.fixture
def cpu(monkeypatch):
    """Pretend this CPU has (True) or lacks (False) native bf16."""
    def set_native(native: bool):
        answer = (native, "avx512_bf16" if native else "no avx512_bf16 or amx (torch: AVX2)")
        monkeypatch.setattr(device, "cpu_bf16_support", lambda cpuinfo=None: answer)
    return set_native


def test_trainer_auto_is_bf16_only_where_the_cpu_computes_it(cpu, caplog):
    cpu_device, gpu = torch.device("cpu"), torch.device("cuda")
    cpu(True)
    assert trainer_module.compute_dtype("auto", cpu_device) == torch.bfloat16
    cpu(False)
    assert trainer_module.compute_dtype("auto", cpu_device) == torch.float32
    assert trainer_module.compute_dtype("auto", gpu) == torch.bfloat16
    assert trainer_module.compute_dtype("float32", gpu) == torch.float32
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert trainer_module.compute_dtype("bfloat16", cpu_device) == torch.bfloat16  # the user's choice stands
    (record,) = caplog.records
    assert "trainer.compute_dtype" in record.getMessage() and "no native bf16" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_engine_auto_and_refusals(cpu, caplog):
    cpu(True)
    assert device.engine_dtype("auto", on_accelerator=False)[0] == "bfloat16"
    cpu(False)
    assert device.engine_dtype("auto", on_accelerator=False) == ("float32", "CPU without native bf16: no avx512_bf16 or amx (torch: AVX2)")
    assert device.engine_dtype("auto", on_accelerator=True)[0] == "bfloat16"
    assert device.engine_dtype("float16", on_accelerator=True)[0] == "float16"
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert device.engine_dtype("bfloat16", on_accelerator=False)[0] == "bfloat16"  # runs, emulated: a warning
    (record,) = caplog.records
    assert "config key 'model.dtype' is bfloat16" in record.getMessage() and "\n" not in record.getMessage()


def test_an_engine_dtype_the_platform_cannot_run_is_refused(cpu, monkeypatch):
    from vllm.platforms import current_platform

    cpu(True)
    # vLLM's CPU platform on a Mac without FEAT_BF16 lists only fp16 and fp32.
    monkeypatch.setattr(type(current_platform), "supported_dtypes", property(lambda self: [torch.float16, torch.float32]))
    with pytest.raises(ValueError, match=r"^config key 'model.dtype': vLLM cannot run bfloat16 on this CPU \(it runs float16, float32\)"):
        device.engine_dtype("bfloat16", on_accelerator=False)
    assert device.engine_dtype("bfloat16", on_accelerator=False, engine="hf")[0] == "bfloat16"


def test_native_fp16_flags():
    assert not device.cpu_fp16_support(EPYC_GENOA) and device.cpu_fp16_support(SAPPHIRE_RAPIDS.replace("amx_int8", "amx_int8 amx_fp16"))
    assert device.cpu_fp16_support("Features\t: fp asimd asimdhp\n")


def test_preloads_are_existing_libraries():
    for lib in device.cpu_preloads():
        assert lib.endswith((".so", ".so.4")) and ("tcmalloc" in lib or "iomp" in lib)
        with open(lib, "rb") as f:
            assert f.read(4) == b"\x7fELF"


def test_the_engine_preloads_what_the_user_has_not(monkeypatch):
    from raytool.engines import vllm_engine

    monkeypatch.setattr(device, "cpu_preloads", lambda: ["/usr/lib/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"])
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so.2")  # the user's own allocator stays the only one
    vllm_engine._preload_cpu_libraries()
    assert device.os.environ["LD_PRELOAD"] == "/venv/lib/libiomp5.so:/opt/libjemalloc.so.2"
    monkeypatch.setenv("LD_PRELOAD", "")
    vllm_engine._preload_cpu_libraries()
    assert device.os.environ["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"


def test_an_engine_without_an_allocator_to_preload_says_once_what_it_costs(monkeypatch, caplog):
    from raytool.engines import vllm_engine

    monkeypatch.setattr(device, "cpu_preloads", lambda: ["/venv/lib/libiomp5.so"])  # no tcmalloc on this machine
    monkeypatch.setenv("LD_PRELOAD", "")
    with caplog.at_level(logging.WARNING, logger="raytool.engines.vllm_engine"):
        vllm_engine._preload_cpu_libraries()
    lines = [r.getMessage() for r in caplog.records if r.name == "raytool.engines.vllm_engine"]
    assert len(lines) == 1 and "about 18% slower" in lines[0] and "apt-get install libtcmalloc-minimal4" in lines[0]
    caplog.clear()
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so.2")  # the user's own allocator: nothing to say
    with caplog.at_level(logging.WARNING, logger="raytool.engines.vllm_engine"):
        vllm_engine._preload_cpu_libraries()
    assert [r for r in caplog.records if r.name == "raytool.engines.vllm_engine"] == []
    # The driver says the same on the console before any engine starts (the engine's line is in its actor's log).
    assert device.fast_allocator_missing("") and not device.fast_allocator_missing("/opt/libjemalloc.so.2")
    monkeypatch.setattr(device, "cpu_preloads", lambda: ["/usr/lib/libtcmalloc_minimal.so.4"])
    assert not device.fast_allocator_missing("")


def test_the_graph_gets_one_resolved_engine_dtype(cpu, caplog, monkeypatch):
    import msgspec
    from vllm.platforms import current_platform

    from raytool.resolve import with_engine_dtype
    from raytool.config import ConfigError, RunConfig

    cfg = RunConfig()
    cpu(False)
    with caplog.at_level(logging.INFO, logger="raytool.resolve"):
        assert with_engine_dtype(cfg).model.dtype == "float32"
    assert "model.dtype auto: float32 (CPU without native bf16" in caplog.text
    cpu(True)
    assert with_engine_dtype(cfg).model.dtype == "bfloat16"
    on_gpus = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, num_gpus=1))
    assert with_engine_dtype(on_gpus).model.dtype == "bfloat16"
    monkeypatch.setattr(type(current_platform), "supported_dtypes", property(lambda self: [torch.bfloat16, torch.float32]))
    fp16 = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, dtype="float16"))
    with pytest.raises(ConfigError, match=r"^config key 'model.dtype': vLLM cannot run float16 on this CPU"):
        with_engine_dtype(fp16)


def test_shared_memory_segments_of_killed_engines_are_removed_and_live_ones_kept(tmp_path):
    """A psm_* segment nobody maps or holds open and older than the grace period goes; one this
    process maps, one just created (an engine core mid-start) and other files stay."""
    import mmap
    import os

    from raytool.engines.vllm_engine import unlink_orphaned_segments

    old = time.time() - 600
    for name in ("psm_dead", "psm_mapped", "psm_new", "other_file"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "psm_new":
            os.utime(tmp_path / name, (old, old))
    with open(tmp_path / "psm_mapped", "r+b") as f, mmap.mmap(f.fileno(), 4096):
        # /proc/<pid>/maps names the file by its path: this test's mapping keeps it
        removed = unlink_orphaned_segments(min_age_s=120, shm=str(tmp_path))
    assert removed == [str(tmp_path / "psm_dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_file", "psm_mapped", "psm_new"]


def test_threads_per_process_follow_the_cores_it_reserves_on_an_accelerator_node():
    """cluster.torch_threads 0: a trainer rank with a GPU and 8 Ray CPUs takes 8 threads, not all of
    its node's cores (8 ranks a node would contend in the optimizer step); on a CPU the engine and
    the trainer take every core in turn; a set value wins."""
    import os

    from raytool.device import torch_threads

    assert torch_threads(0, num_cpus=8, num_accelerators=1) == 8
    assert torch_threads(0, num_cpus=0.5, num_accelerators=1) == len(os.sched_getaffinity(0))  # no whole core reserved
    assert torch_threads(0, num_cpus=1, num_accelerators=0) == len(os.sched_getaffinity(0))
    assert torch_threads(3, num_cpus=8, num_accelerators=1) == 3


def test_a_host_whose_name_resolves_to_loopback_cannot_join_a_multi_host_trainer(monkeypatch):
    """Stock Ubuntu's /etc/hosts maps the host name to 127.0.1.1, which gloo binds without
    GLOO_SOCKET_IFNAME: other hosts' ranks could not connect (the group would hang to its timeout)."""
    import socket

    from raytool.device import unreachable_gloo_address

    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert unreachable_gloo_address({}) == "host name node-a resolves to 127.0.1.1, a loopback address"
    assert unreachable_gloo_address({"GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert unreachable_gloo_address({"GLOO_SOCKET_IFNAME": "lo"}) == "GLOO_SOCKET_IFNAME=lo is the loopback interface"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.0.0.7")
    assert unreachable_gloo_address({}) is None
