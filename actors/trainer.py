"""TrainerWorker (one per device) and TrainerGroup (its placement group and process group)."""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.common import Liveness, actor_options, alive_pid
from raytool.config import RunConfig
from raytool.device import accelerator_memory, detect, set_torch_threads, torch_threads, unreachable_gloo_address
from raytool.errors import ActorStartError, RaytoolError, one_line, start_failure
from raytool.resolve import with_trainer_autos
from raytool import placement, storage
from raytool.streaming import RolloutBatch
from raytool.training import Trainer
from raytool.training.batching import split_across_ranks
from raytool.training.model import DTYPES
from raytool.types import SFTExample, TrainBatch
from raytool.weightsync import WeightSender


@ray.remote(concurrency_groups={"heartbeat": 1})
class TrainerWorker:
    """One trainer rank. Its calls run one at a time, in order; `heartbeat` runs on a thread of its
    own, so the driver tells a rank busy in a long update (or a model load) from a hung process."""

    def __init__(self, rank: int, world_size: int, model_path: str, cfg: RunConfig):
        set_torch_threads(torch_threads(cfg.cluster.torch_threads, cfg.trainer.num_cpus, cfg.trainer.num_gpus))
        self.rank, self.world_size = rank, world_size
        self.model_path, self.cfg = model_path, cfg
        self.trainer: Trainer | None = None
        self.sender: WeightSender | None = None
        self._sender_key: tuple = ()
        self._store = None  # rank 0's process-group store (rendezvous_address)

    @ray.method(concurrency_group="heartbeat")
    def heartbeat(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> str:
        """Rank 0 opens the process group's store on a port the OS gives it and holds it open: a
        port picked free and bound later can be taken in between by another process."""
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False)
        return f"{host}:{self._store.port}"

    def resolved(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the trainer's autos decided for this rank's device and its memory
        (raytool.resolve.with_trainer_autos): rank 0's decision is every rank's."""
        import torch

        device = detect()
        local = torch.device("cuda" if device.kind == "cuda" else device.kind)
        return with_trainer_autos(cfg, self.model_path, device.kind != "cpu", accelerator_memory(local))

    def setup(self, rendezvous: str | None, hosts: int = 1, cfg: RunConfig | None = None) -> None:
        """Join the process group (`hosts`: the machines its ranks are on) and build the trainer
        (`cfg`: the run's, its trainer autos decided; None: the one this worker was made with)."""
        self.cfg = cfg or self.cfg
        device = detect()
        if hosts > 1 and (why := unreachable_gloo_address()) is not None:
            raise RaytoolError(f"trainer rank {self.rank} on {ray.util.get_node_ip_address()}: the trainer spans {hosts} hosts, but {why}, "
                               "which the others cannot reach: set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME) to "
                               "the nodes' network interface, in the cluster file's container environment or in cluster.env_vars")
        if self.world_size > 1:
            import torch.distributed as dist

            store = self._store
            if store is None:
                host, port = rendezvous.rsplit(":", 1)
                store = dist.TCPStore(host, int(port), self.world_size, is_master=False)
            dist.init_process_group(device.process_group_backend, store=store, rank=self.rank, world_size=self.world_size)
        local = "cuda" if device.kind == "cuda" else device.kind
        self.trainer = Trainer(self.cfg, self.model_path, device=local, rank=self.rank, world_size=self.world_size)

    def rl_step(self, share: list, rewards: list[float], groups: list[int], offsets: list[int], trained: list[bool]) -> dict:
        """`share`: [(train sequences ref of group g, g, positions)] — only this rank's groups'
        sequences are fetched from the object store; rewards/groups/trained describe the whole batch."""
        fetched = ray.get([ref for ref, _, _ in share])
        own, index = [], []
        for sequences, (_, g, positions) in zip(fetched, share):
            for i in positions:
                own.append(sequences[i])
                index.append(offsets[g] + i)
        return self.trainer.rl_step(TrainBatch(own, index, rewards, groups, trained))

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        return self.trainer.sft_step(examples, lr)

    def sft_val_loss(self, examples: list[SFTExample]) -> float:
        return self.trainer.sft_val_loss(examples)

    def start_rl(self, snapshot_reference: bool) -> None:
        self.trainer.start_rl(snapshot_reference=snapshot_reference)

    def send_weights(self, addresses: list[str], version: int, bucket_bytes: int, timeout_s: float, attempt: int = 0) -> dict:
        """Rank 0 streams; the other ranks take part in gathering full tensors from their shards."""
        if self.cfg.model.dtype not in DTYPES:  # actors.drivers.compose.build resolves model.dtype before any engine starts
            raise ValueError(f"model.dtype {self.cfg.model.dtype!r} was not resolved before the weight sync")
        weights = self.trainer.named_weights(DTYPES[self.cfg.model.dtype])
        if self.rank != 0:
            for _ in weights:  # each step of the iteration is an all-gather rank 0 waits on
                continue
            return {}
        backend = self.cfg.trainer.weight_sync_backend  # resolved: zmq or collective
        key = (tuple(addresses), bucket_bytes, timeout_s, backend)
        if self.sender is None or self._sender_key != key:
            if self.sender is not None:
                self.sender.close()
            # Ray's node IP: receivers on this node then read the weights in place (CUDA IPC, shared memory).
            self.sender, self._sender_key = WeightSender(
                addresses, bucket_bytes, timeout_s, node_ip=ray.util.get_node_ip_address(),
                ipc=None if self.cfg.trainer.weight_sync_in_place else False, backend=backend,
            ), key
        try:
            return self.sender.send(weights, version, attempt)
        finally:
            for _ in weights:  # a failed send still takes part in the other ranks' all-gathers
                continue

    def close(self) -> None:
        """Release the weight sender (its sockets and shared-memory staging files, which a killed
        process would leave in /dev/shm)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def save_checkpoint(self, directory: str) -> str:
        return str(self.trainer.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)

    def export_hf(self, directory: str) -> str:
        return str(self.trainer.export_hf(directory))

    def write_probe(self, location: str, token: str) -> str:
        """Leave this rank's probe at `location`; returns this rank's node (for the error)."""
        storage.write_probe(location, self.rank, token)
        return ray.util.get_node_ip_address()

    def seen_probes(self, location: str, token: str) -> list[int]:
        return storage.seen_probes(location, token, self.world_size)


class TrainerLost(RaytoolError):
    """A trainer worker's process died or hung: the group cannot go on (its ranks share one model)."""


class TrainerGroup:
    """N TrainerWorkers in one placement group, joined in a torch process group when N > 1.

    Every call waits on all ranks and fails fast: a rank whose process died raises TrainerLost at
    once, naming it, while the others may be blocked in a collective with it. While it waits, it
    pings the ranks' heartbeats every cluster.heartbeat_s: a rank silent for a whole interval (a
    stopped or hung process) is killed and raises TrainerLost too, so no wait on the trainer is
    unbounded."""

    def __init__(self, cfg: RunConfig, model_path: str, namespace: str | None = None, wait: bool = True):
        """Workers are named `trainer-<rank>` in `namespace` (None: anonymous). `wait=False`: return
        once the ranks are asked to set up (their model loads meanwhile); `started()` then waits."""
        t, c = cfg.trainer, cfg.cluster
        self.cfg = cfg
        self.heartbeat_s = c.heartbeat_s
        self.liveness = Liveness()  # a rank still in its constructor is late, not hung
        self.closed = False
        bundle = placement.bundle(cfg, "trainer worker")  # what the driver checked the cluster can hold
        self.pg = None
        strategy = None
        if bundle:
            self.pg = placement_group([dict(bundle) for _ in range(t.num_workers)], strategy="PACK")
            self._wait_placed(bundle, t.num_workers, c.placement_timeout_s)
        self.workers = []
        for rank in range(t.num_workers):
            if self.pg is not None:
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            named = {"name": f"trainer-{rank}", "namespace": namespace} if namespace else {}
            opts = actor_options(t.num_cpus, t.num_gpus, c.accelerator, c.env_vars, scheduling_strategy=strategy, **named)
            self.workers.append(TrainerWorker.options(**opts).remote(rank, t.num_workers, model_path, cfg))
        # Every rank's setup takes rank 0's store address and rank 0's decision of the trainer's
        # autos, on its device (Ray hands each result on once it is there): one decision for every rank.
        self._resolved = self.workers[0].resolved.remote(cfg)
        self._rendezvous = [self.workers[0].rendezvous_address.remote()] if t.num_workers > 1 else []
        hosts = self._hosts()
        self._setups = [w.setup.remote(self._rendezvous[0] if self._rendezvous else None, hosts, self._resolved) for w in self.workers]
        if wait:
            self.started()

    def _hosts(self) -> int:
        """How many machines (node IP addresses: raylets of one machine share theirs) the placed ranks are on."""
        if self.pg is None:
            return 1
        nodes = set(ray.util.placement_group_table(self.pg)["bundles_to_node_id"].values())
        return len({n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] in nodes}) or 1

    def started(self) -> None:
        """Wait for every rank's setup: ActorStartError naming the cause, or TrainerLost for a rank
        that died or hung meanwhile; either way the group is shut down."""
        try:
            self.gather(self._rendezvous)  # rank 0 dead before its store opened is named as rank 0
            self.gather(self._setups)
            self.cfg = ray.get(self._resolved)  # the trainer's autos decided (the driver records them in config.yaml)
        except ray.exceptions.RayError as exc:
            self.shutdown()
            raise ActorStartError(f"trainer failed to start: {start_failure(exc)}") from exc
        except TrainerLost:
            self.shutdown()
            raise

    def _wait_placed(self, bundle: dict, count: int, timeout_s: float) -> None:
        """Ray leaves a placement group it cannot place pending forever: give up after `timeout_s`
        with what it waits for and what the cluster has free."""
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            free = ", ".join(f"{v:g} {k}" for k, v in sorted(ray.available_resources().items()) if "_group_" not in k and not k.startswith("node:"))
            wanted = ", ".join(f"{v:g} {k}" for k, v in sorted(bundle.items()) if v)
            raise placement.PlacementError(
                f"the trainer's placement group ({count} x {{{wanted}}}) was not placed within {timeout_s:g}s "
                f"(cluster.placement_timeout_s); free now: {free or 'nothing'} (config keys trainer.num_workers, trainer.num_cpus, trainer.num_gpus)"
            ) from None

    def gather(self, refs: list) -> list:
        """Every rank's result of one call, in rank order; TrainerLost as soon as one rank died or
        hung (silent for a heartbeat interval)."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.heartbeat_s or None)
            if not ready:
                self.check_heartbeats(sorted(pending.values()))
                continue
            rank = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                ray.kill(self.workers[rank])  # unreachable is not always dead: make sure
                raise TrainerLost(f"trainer-{rank} died: {one_line(exc)}") from exc
        return ray.get(refs)

    def check_heartbeats(self, ranks: list[int] | None = None) -> None:
        """Ping `ranks` (all by default); kill the first that stays silent for a heartbeat interval
        while running (`actors.common.Liveness`) or cannot be reached -> TrainerLost. Nothing to do
        when heartbeats are off (cluster.heartbeat_s=0)."""
        if not self.heartbeat_s:
            return
        pings = {self.workers[rank].heartbeat.remote(): rank for rank in (range(len(self.workers)) if ranks is None else ranks)}
        answered, late = ray.wait(list(pings), num_returns=len(pings), timeout=self.heartbeat_s)
        for ref in answered:
            try:
                self.liveness.answered(f"trainer-{pings[ref]}", ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                ray.kill(self.workers[pings[ref]])
                raise TrainerLost(f"trainer-{pings[ref]} cannot be reached: {one_line(exc)}") from exc
        hung = [rank for rank in sorted(pings[ref] for ref in late) if self.liveness.hung(f"trainer-{rank}", alive_pid(self.workers[rank]))]
        if hung:
            rank = hung[0]
            ray.kill(self.workers[rank])
            raise TrainerLost(f"trainer-{rank} did not answer a heartbeat within cluster.heartbeat_s={self.heartbeat_s:g}s "
                              "(a stopped or hung process): killed")

    def check_storage(self, location: str, key: str = "trainer.checkpoint_dir") -> None:
        """Every rank writes a probe at `location` and reads every rank's back: a rank that cannot
        write there, or does not see what the others wrote (a directory local to one node), stops
        the run here, in one line naming `key`, instead of at the first resume or export."""
        token = uuid.uuid4().hex
        probe = storage.join(location, f".probe-{token}")
        try:
            nodes = self.gather([w.write_probe.remote(probe, token) for w in self.workers])
            seen = self.gather([w.seen_probes.remote(probe, token) for w in self.workers])
        except ray.exceptions.RayTaskError as exc:
            raise RaytoolError(f"{key}={location}: a trainer rank cannot write or read there: {one_line(exc)}") from None
        finally:
            try:
                storage.remove(probe)
            except OSError:
                pass  # a location the driver cannot reach: the ranks' answers say what matters
        everyone = set(range(len(self.workers)))
        blind = {rank: sorted(everyone - set(ranks)) for rank, ranks in enumerate(seen) if set(ranks) != everyone}
        if blind:
            rank, missing = min(blind.items(), key=lambda item: (0 not in item[1], item[0]))  # "rank N does not see rank 0's" first
            raise RaytoolError(
                f"{key}={location}: trainer rank {rank} (node {nodes[rank]}) does not see the files rank(s) "
                f"{', '.join(map(str, missing))} wrote there, so a checkpoint would be split across nodes; "
                "use a path every node mounts (NFS) or an fsspec URI such as s3://bucket/path"
            )

    def rl_step_refs(self, batch: RolloutBatch) -> list:
        """Start one update on `batch` -> the workers' result refs (each rank's metrics, the same on
        every rank). Each rank fetches only its balanced share of the batch's train sequences."""
        rewards, groups, offsets, trained = batch.rewards, batch.group_index, batch.offsets, batch.trained
        shares = split_across_ranks(batch.lengths(), len(self.workers), self.cfg.trainer.sequence_parallel_size)
        return [
            w.rl_step.remote([(batch.groups[g].ref.sequences, g, positions) for g, positions in sorted(share.items())], rewards, groups, offsets, trained)
            for w, share in zip(self.workers, shares)
        ]

    def rl_step(self, batch: RolloutBatch) -> dict:
        return self.gather(self.rl_step_refs(batch))[0]

    def _slices(self, examples: list[SFTExample]) -> list:
        """Each rank's share of an SFT batch, in the object store (a rank fetches only its own; the
        ranks of a sequence-parallel group share one)."""
        sp = self.cfg.trainer.sequence_parallel_size
        dp = len(self.workers) // sp
        parts = [ray.put(examples[k::dp]) for k in range(dp)]
        return [parts[rank // sp] for rank in range(len(self.workers))]

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        return self.gather([w.sft_step.remote(part, lr) for w, part in zip(self.workers, self._slices(examples))])[0]

    def sft_val_loss(self, examples: list[SFTExample]) -> float:
        return self.gather([w.sft_val_loss.remote(part) for w, part in zip(self.workers, self._slices(examples))])[0]

    def start_rl(self, snapshot_reference: bool) -> None:
        """Between the in-run SFT warm-up and GRPO: a fresh optimizer, the KL reference frozen if asked."""
        self.gather([w.start_rl.remote(snapshot_reference) for w in self.workers])

    def send_weights(self, addresses: list[str], version: int, bucket_bytes: int, timeout_s: float = 120.0, attempt: int = 0) -> list:
        """Object refs of the sending calls (the receivers must be listening concurrently)."""
        return [w.send_weights.remote(addresses, version, bucket_bytes, timeout_s, attempt) for w in self.workers]

    def save_checkpoint(self, directory: str) -> str:
        return self.gather([w.save_checkpoint.remote(os.fspath(directory)) for w in self.workers])[0]

    def load_checkpoint(self, directory: str) -> None:
        self.gather([w.load_checkpoint.remote(os.fspath(directory)) for w in self.workers])

    def export_hf(self, directory: str) -> str:
        return self.gather([w.export_hf.remote(os.fspath(directory)) for w in self.workers])[0]

    def shutdown(self, close: bool = True) -> None:
        """Close the ranks (up to 10 s; `close=False`: a group given up on while starting is not
        asked), then kill them and free their placement group. Once; again is a no-op."""
        if self.closed:
            return
        self.closed = True
        if close:
            ray.wait([w.close.remote() for w in self.workers], num_returns=len(self.workers), timeout=10)
        for w in self.workers:
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
