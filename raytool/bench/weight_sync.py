"""`raytool bench weight-sync`: a full weight sync of the run's model against raw ZMQ, and its fan-out.

Measured in one run, on the same machine, so the ratios hold on a noisy shared host:
- `raw_zmq_gbps`: PUSH/PULL of the checkpoint's bytes over loopback TCP in the same buckets, one
  frame per tensor piece as a sync sends them, but bare (no header, checksum, threads or
  version checks): what the transport gives;
- `sync_gbps`, `sync_vs_raw`, `fanout4_vs_1`: `WeightSender.send` of the checkpoint's tensors as
  a run sends them to rollout servers on the trainer's node: the receivers read the sender's
  staging buffers in place (shared memory here, CUDA IPC for GPU weights), to 1 and 4 receivers;
- `tcp_*`: the same syncs over TCP, the path to servers on other nodes: to 1, 2 and 4 receivers
  down the relay chain, and direct fan-out to 4 (every bucket sent 4 times) for comparison. On
  one host both are bound by CPU and memory bandwidth (each receiver costs two more copies
  through the kernel); the chain pays off across hosts, where each link has its own bandwidth;
- `collective_*`: the same syncs by a collective (trainer.weight_sync_backend=collective): gloo's
  broadcast here, the path NCCL and HCCL take on accelerators, to 1 and 4 receivers, against the
  TCP relay chain (`collective_vs_tcp`: seconds over seconds, lower is faster);
- `attestation_cost`: the in-place sync (the one path where digests are an added pass: elsewhere
  they are the checksum) against the same sync with the digests left out on both sides, as a
  fraction (0.05: 5% slower); `attestation_s`: one side's digests of a whole sync on their own;
- `seconds_to_live_engine`: from the start of a sync of perturbed weights into a live vLLM engine
  (this process, its workers in child processes) to its first answer on them (left out, with
  the reason, where vLLM cannot start).

Receivers run in spawned processes, as rollout servers do, so no two sides share a GIL. Each
figure is the best of `REPEATS`, the raw and sync ones interleaved.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import torch

from raytool.config import RunConfig


RECEIVERS = 4
REPEATS = 7
TIMEOUT_S = 120.0


def _receiver_process(rank: int, commands, results, ns: str | None = None, host: str = "127.0.0.1") -> None:
    """One receiver: a WeightReceiver for syncs and a bare PULL socket for raw transfers, on
    `host`; with `ns`, in that simulated node's network namespace (raytool.bench.netns)."""
    import zmq

    from raytool.weightsync import WeightReceiver

    if ns is not None:
        from raytool.bench import netns

        netns.enter(ns)
    receiver = WeightReceiver(host)
    raw = zmq.Context.instance().socket(zmq.PULL)
    raw_port = raw.bind_to_random_port(f"tcp://{host}")
    results.put((rank, receiver.address, f"tcp://{host}:{raw_port}"))
    from raytool.weightsync import receiver as receiver_module

    attested = receiver_module.digest
    while (command := commands.get())[0] != "stop":
        kind, arg = command
        if kind in ("sync", "unattested"):  # unattested: the A/B baseline of attestation's cost, digests left out on both sides
            receiver_module.digest = attested if kind == "sync" else _no_digest
            tensors = sum(len(bucket) for bucket in receiver.receive(arg, TIMEOUT_S))
        else:  # "raw": arg messages
            for _ in range(arg):
                raw.recv_multipart(copy=False)
            tensors = 0
        results.put((time.perf_counter(), tensors))
    receiver.close()
    raw.close(linger=0)


def _no_digest(chunk) -> int:
    return 0


def _load_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: the weight-sync bench reads the checkpoint's tensors from them")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class _Receivers:
    """Spawned receiver processes and the commands that time them; with `nodes`, receiver i in
    namespace nodes[i][0] on address nodes[i][1]."""

    def __init__(self, n: int, nodes: list[tuple[str, str]] | None = None):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_receiver_process, args=(i, c, self.results, *(nodes[i] if nodes else ())), daemon=True)
                      for i, c in enumerate(self.commands)]
        for p in self.procs:
            p.start()
        ready = sorted(self.results.get(timeout=TIMEOUT_S) for _ in self.procs)
        self.sync_addresses = [s for _, s, _ in ready]
        self.raw_addresses = [r for _, _, r in ready]

    def wait(self, n: int) -> tuple[float, list[int]]:
        """The time the last of n receivers finished, and what each received."""
        done = [self.results.get(timeout=TIMEOUT_S) for _ in range(n)]
        return max(t for t, _ in done), [k for _, k in done]

    def command(self, addresses: list[str], kind: str, arg: int) -> None:
        for address in addresses:
            self.commands[self.raw_addresses.index(address) if kind == "raw" else self.sync_addresses.index(address)].put((kind, arg))

    def stop(self) -> None:
        for c in self.commands:
            c.put(("stop", 0))
        for p in self.procs:
            p.join(10)


def _raw_messages(state: dict, bucket_bytes: int) -> list[list[memoryview]]:
    """The state's bytes as messages of at most bucket_bytes, one frame per tensor piece."""
    messages, frames, used = [], [], 0
    for tensor in state.values():
        flat = tensor.reshape(-1).view(torch.uint8)
        done = 0
        while True:
            if used == bucket_bytes:
                messages.append(frames)
                frames, used = [], 0
            take = min(flat.numel() - done, bucket_bytes - used)
            frames.append(memoryview(flat[done : done + take].numpy()))
            used, done = used + take, done + take
            if done == flat.numel():
                break
    return [*messages, frames]


def _raw_seconds(receivers: _Receivers, messages: list[list[memoryview]]) -> float:
    """Push the messages to one receiver; seconds to its last byte."""
    import zmq

    address = receivers.raw_addresses[0]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    receivers.command([address], "raw", len(messages))
    time.sleep(0.05)  # the receiver is waiting, as it is for a sync
    start = time.perf_counter()
    for frames in messages:
        sock.send_multipart([b"h", *frames], copy=False)
    end, _ = receivers.wait(1)
    sock.close(linger=-1)
    return end - start


def _sync_seconds(receivers: _Receivers, sender, state: dict, version: int, addresses: list[str], attest: bool = True) -> tuple[float, dict]:
    from raytool.weightsync import sender as sender_module

    receivers.command(addresses, "sync" if attest else "unattested", version)
    time.sleep(0.05)
    start = time.perf_counter()
    attested = sender_module.digest
    sender_module.digest = attested if attest else _no_digest
    try:
        stats = sender.send(state.items(), version)
    finally:
        sender_module.digest = attested
    end, counts = receivers.wait(len(addresses))
    if counts != [len(state)] * len(addresses):
        raise RuntimeError(f"weight-sync bench: receivers got {counts} tensors, expected {len(state)} each")
    return end - start, stats


def _transport(state: dict, bucket_bytes: int) -> dict:
    from raytool.weightsync import WeightSender

    receivers = _Receivers(RECEIVERS)
    try:
        addresses = receivers.sync_addresses
        senders = {
            "1": WeightSender(addresses[:1], bucket_bytes, ipc=False),
            "2": WeightSender(addresses[:2], bucket_bytes, ipc=False),
            "4": WeightSender(addresses, bucket_bytes, ipc=False),
            "direct4": WeightSender(addresses, bucket_bytes, fanout="direct", ipc=False),
            "same_node_1": WeightSender(addresses[:1], bucket_bytes, ipc=True),
            "same_node_4": WeightSender(addresses, bucket_bytes, ipc=True),
            "same_node_1_unattested": WeightSender(addresses[:1], bucket_bytes, ipc=True),
            "collective_1": WeightSender(addresses[:1], bucket_bytes, backend="collective", send_timeout_s=TIMEOUT_S),
            "collective_4": WeightSender(addresses, bucket_bytes, backend="collective", send_timeout_s=TIMEOUT_S),
        }
        messages = _raw_messages(state, bucket_bytes)
        version = 0
        for key, sender in senders.items():  # warm-up: staging buffers, connections, mappings
            _, stats = _sync_seconds(receivers, sender, state, version := version + 1, sender.addresses, not key.endswith("_unattested"))
        _raw_seconds(receivers, messages)
        times: dict[str, list[float]] = {k: [] for k in ("raw", *senders)}
        for _ in range(REPEATS):
            times["raw"].append(_raw_seconds(receivers, messages))
            for key, sender in senders.items():
                times[key].append(_sync_seconds(receivers, sender, state, version := version + 1, sender.addresses,
                                                not key.endswith("_unattested"))[0])
        for sender in senders.values():
            sender.close()
    finally:
        receivers.stop()
    median = {k: min(v) for k, v in times.items()}  # the best of REPEATS: what each path can do when the host lets it
    return {"bytes": stats["bytes"], "buckets": stats["buckets"], **{f"{k}_s": v for k, v in median.items()},
            "attestation_s": _attestation_seconds(state)}


def _attestation_seconds(state: dict) -> float:
    """One side's digests of a whole sync (every tensor's bytes, as the sender and each receiver
    take them), the best of REPEATS: what attestation adds to a sync where no checksum of the
    bytes was taken before (in place); over TCP and by a collective it is the checksum itself."""
    from raytool.weightsync.protocol import digest

    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in state.values()]
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for chunk in flat:
            digest(chunk)
        best = min(best, time.perf_counter() - start)
    return best


def _live_engine_seconds(cfg: RunConfig, model_dir: str, state: dict) -> float:
    """Start a vLLM engine (not timed), then time a sync of perturbed weights until the engine
    answers a greedy request differently from before."""
    import asyncio

    from raytool.engines.vllm_engine import VLLMEngine
    from raytool.types import SamplingParams
    from raytool.device import engine_dtype
    from raytool.weightsync import WeightSender

    r = cfg.rollout
    engine = VLLMEngine(
        model_dir, dtype=engine_dtype(cfg.model.dtype, on_accelerator=torch.cuda.is_available())[0], max_batch_size=4, cpu_kv_cache_gb=r.cpu_kv_cache_gb,
        enforce_eager=r.enforce_eager, max_model_len=512,
    )
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * v.float().std().to(v.dtype) * torch.randn(v.shape, generator=g).to(v.dtype) if v.ndim > 1 else v for k, v in state.items()}
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = [1, 4093, 198, 2020, 800]

    async def run() -> float:
        before = (await engine.generate(prompt, greedy, "before")).token_ids
        addresses = await engine.bind_weight_receivers("127.0.0.1")
        sender = WeightSender(addresses, cfg.trainer.weight_sync_bucket_mb << 20)
        try:
            start = time.perf_counter()
            receiving = asyncio.create_task(engine.receive_weights(1, TIMEOUT_S))
            await asyncio.to_thread(sender.send, perturbed.items(), 1)
            await receiving
            after = (await engine.generate(prompt, greedy, "after")).token_ids
            seconds = time.perf_counter() - start
        finally:
            sender.close()
        if after == before:
            raise RuntimeError("weight-sync bench: the engine answered the same after a sync of perturbed weights")
        return seconds

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def bench(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.models import resolve_model

    model_dir = resolve_model(cfg.model.path)
    state = _load_state_dict(model_dir)
    bucket_bytes = cfg.trainer.weight_sync_bucket_mb << 20
    m = _transport(state, bucket_bytes)
    gb = m["bytes"] / 1e9
    result = {
        "model": cfg.model.path,
        "gb": round(gb, 3),
        "buckets": m["buckets"],
        "bucket_mb": cfg.trainer.weight_sync_bucket_mb,
        "raw_zmq_gbps": round(gb / m["raw_s"], 3),
        # The path a run takes with the receivers on the trainer's node (in place, the default):
        "sync_gbps": round(gb / m["same_node_1_s"], 3),
        "sync_vs_raw": round(m["raw_s"] / m["same_node_1_s"], 3),
        "fanout4_vs_1": round(m["same_node_4_s"] / m["same_node_1_s"], 3),
        # Over TCP, the path to receivers on other nodes (relay chain, and direct for comparison):
        "tcp_sync_gbps": round(gb / m["1_s"], 3),
        "tcp_sync_vs_raw": round(m["raw_s"] / m["1_s"], 3),
        "tcp_fanout2_vs_1": round(m["2_s"] / m["1_s"], 3),
        "tcp_fanout4_vs_1": round(m["4_s"] / m["1_s"], 3),
        "tcp_direct4_vs_1": round(m["direct4_s"] / m["1_s"], 3),
        # By a collective (gloo here; NCCL/HCCL on accelerators), against the TCP relay chain:
        "collective_sync_gbps": round(gb / m["collective_1_s"], 3),
        "collective_vs_tcp": round(m["collective_1_s"] / m["1_s"], 3),
        "collective_fanout4_vs_1": round(m["collective_4_s"] / m["collective_1_s"], 3),
        # Attestation: the in-place sync with its digests against the same sync without them (A/B,
        # alternating), and one side's digests of the whole sync on their own.
        "attestation_cost": round(m["same_node_1_s"] / m["same_node_1_unattested_s"] - 1, 3),
        "attestation_s": round(m["attestation_s"], 4),
        "attestation_share_of_sync": round(m["attestation_s"] / m["same_node_1_s"], 3),
        "seconds": {k.removesuffix("_s"): round(v, 3) for k, v in m.items() if k.endswith("_s")},
    }
    try:
        result["seconds_to_live_engine"] = round(_live_engine_seconds(cfg, model_dir, state), 3)
    except ImportError as exc:
        result["seconds_to_live_engine"] = None
        result["live_engine_skipped"] = f"vLLM is not importable here: {exc}"
    rows = [("path", "receivers", "seconds", "GB/s", "vs 1")]
    rows.append(("raw ZMQ", 1, round(m["raw_s"], 3), result["raw_zmq_gbps"], "-"))
    for key, n, how, one in (
        ("1", 1, "tcp chain", "1"), ("2", 2, "tcp chain", "1"), ("4", 4, "tcp chain", "1"), ("direct4", 4, "tcp direct", "1"),
        ("same_node_1", 1, "same node", "same_node_1"), ("same_node_4", 4, "same node", "same_node_1"),
        ("collective_1", 1, "gloo", "collective_1"), ("collective_4", 4, "gloo", "collective_1"),
    ):
        rows.append((how, n, round(m[f"{key}_s"], 3), round(gb / m[f"{key}_s"], 3), round(m[f"{key}_s"] / m[f"{one}_s"], 3)))
    table = "\n".join(f"{a!s:<12}{b!s:>10}{c!s:>10}{d!s:>8}{e!s:>8}" for a, b, c, d, e in rows)
    table += (
        f"\n\n{cfg.model.path}: {gb:.3f} GB in {m['buckets']} buckets of {cfg.trainer.weight_sync_bucket_mb} MiB; "
        f"same node (in place, the default there) sync/raw {result['sync_vs_raw']}, fan-out 4/1 {result['fanout4_vs_1']}; "
        f"tcp (other nodes) sync/raw {result['tcp_sync_vs_raw']}, fan-out 4/1 {result['tcp_fanout4_vs_1']}; "
        f"collective (gloo) / tcp {result['collective_vs_tcp']}, fan-out 4/1 {result['collective_fanout4_vs_1']}"
        f"\nattestation: the in-place sync {100 * result['attestation_cost']:+.1f}% against it without digests "
        f"({m['same_node_1_s']:.3f} s vs {m['same_node_1_unattested_s']:.3f} s); one side's digests of the sync alone "
        f"{result['attestation_s']} s"
        f"\nsync start to a live vLLM engine answering on the new weights: {result['seconds_to_live_engine']} s"
    )
    return table, result


# --- simulated nodes: one shaped link each ------------------------------------------------------

LINKED_REPEATS = 3


def _linked_sender(ns: str, model_dir: str, bucket_bytes: int, commands, results) -> None:
    """The trainer's node: sends the checkpoint's tensors when told (addresses, fan-out, version)."""
    from raytool.bench import netns
    from raytool.weightsync import WeightSender

    netns.enter(ns)
    state = _load_state_dict(model_dir)
    senders: dict = {}
    results.put(("ready", sum(t.numel() * t.element_size() for t in state.values())))
    while (command := commands.get()) is not None:
        addresses, fanout, version = command
        key = (tuple(addresses), fanout)
        if key not in senders:
            senders[key] = WeightSender(addresses, bucket_bytes, fanout=fanout, ipc=False, send_timeout_s=TIMEOUT_S)
        start = time.perf_counter()
        stats = senders[key].send(state.items(), version)
        results.put((start, stats["buckets"]))
    for sender in senders.values():
        sender.close()


def linked(model_dir: str, mbit: float, bucket_bytes: int, repeats: int = LINKED_REPEATS) -> dict:
    """Weight syncs between simulated nodes (raytool.bench.netns): the sender on one, each of
    RECEIVERS receivers on another, every node behind its own `mbit` link. Seconds (best of
    `repeats`, interleaved) to 1 receiver, to 4 down the relay chain, and to 4 by direct fan-out."""
    from raytool.bench import netns

    ctx = mp.get_context("spawn")
    with netns.Nodes(RECEIVERS + 1, mbit) as nodes:
        sender_results, sender_commands = ctx.Queue(), ctx.Queue()
        sender = ctx.Process(target=_linked_sender, args=(nodes.names[0], model_dir, bucket_bytes, sender_commands, sender_results), daemon=True)
        sender.start()
        receivers = _Receivers(RECEIVERS, list(zip(nodes.names[1:], nodes.addresses[1:])))
        try:
            addresses = receivers.sync_addresses  # in node order: the chain follows the nodes
            _, total = sender_results.get(timeout=TIMEOUT_S)
            paths = {"1": (addresses[:1], "chain"), "4": (addresses, "chain"), "direct4": (addresses, "direct")}
            times: dict[str, list[float]] = {k: [] for k in paths}
            version = 0
            for _ in range(repeats + 1):  # the first round warms connections up and is not counted
                for key, (targets, fanout) in paths.items():
                    receivers.command(targets, "sync", version := version + 1)
                    time.sleep(0.05)
                    sender_commands.put((targets, fanout, version))
                    start, buckets = sender_results.get(timeout=TIMEOUT_S)
                    end, _ = receivers.wait(len(targets))
                    if version > len(paths):
                        times[key].append(end - start)
        finally:
            sender_commands.put(None)
            receivers.stop()
            sender.join(10)
            if sender.is_alive():
                sender.kill()
    best = {k: min(v) for k, v in times.items()}
    return {
        "link_mbit": mbit, "bytes": total, "buckets": buckets, "link_gbps_used": round(total * 8 / 1e9 / best["1"], 3),
        "linked_fanout4_vs_1": round(best["4"] / best["1"], 3), "linked_direct4_vs_1": round(best["direct4"] / best["1"], 3),
        "seconds": {f"linked_{k}": round(v, 3) for k, v in best.items()},
    }


def linked_bench(cfg: RunConfig, mbit: float) -> tuple[str, dict]:
    """`raytool bench weight-sync --link-mbit M`: the relay chain against direct fan-out between simulated nodes."""
    from raytool.models import resolve_model

    result = {"model": cfg.model.path, "bucket_mb": cfg.trainer.weight_sync_bucket_mb,
              **linked(resolve_model(cfg.model.path), mbit, cfg.trainer.weight_sync_bucket_mb << 20)}
    s = result["seconds"]
    rows = [("path", "receivers", "seconds", "vs 1"), ("chain", 1, s["linked_1"], 1.0), ("chain", 4, s["linked_4"], result["linked_fanout4_vs_1"]),
            ("direct", 4, s["linked_direct4"], result["linked_direct4_vs_1"])]
    table = "\n".join(f"{a!s:<10}{b!s:>10}{c!s:>10}{d!s:>8}" for a, b, c, d in rows)
    table += (f"\n\n{cfg.model.path}: {result['bytes'] / 1e9:.3f} GB in {result['buckets']} buckets of {result['bucket_mb']} MiB; "
              f"each node (sender, 4 receivers) behind one {mbit:g} Mbit/s link; one receiver took "
              f"{result['link_gbps_used']} Gbit/s of it")
    return table, result
