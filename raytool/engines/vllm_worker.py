"""Runs inside each vLLM worker process: a ZMQ receiver that loads the trainer's weights in place.

vLLM mixes this class into its worker (`worker_extension_cls`); the engine calls its methods with
`collective_rpc`. Nothing here may rely on the parent process: it is imported by name in the
worker, which owns the model (`self.model_runner.model`).
"""

from __future__ import annotations

import logging
import time

from raytool.engines.crash import install_crash_recorder
from raytool.weightsync import WeightReceiver, WeightSyncError

log = logging.getLogger(__name__)
install_crash_recorder()  # the exception that kills this worker reaches the rollout server by name


class _RotaryReloadNoise(logging.Filter):
    """vLLM's layerwise reload warns on every sync that rotary embeddings loaded no weights: they
    have none in a checkpoint (their cos/sin cache is computed) and are kept as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage() == "RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNoise())


class WeightSyncExtension:
    def raytool_bind_weight_receiver(self, host: str) -> str:
        receiver = getattr(self, "_raytool_receiver", None)
        if receiver is None:
            receiver = self._raytool_receiver = WeightReceiver(host)
        return receiver.address

    def raytool_receive_weights(self, version: int, timeout_s: float, attempt: int = 0) -> dict:
        """Load one sync bucket by bucket with the model's own `load_weights` (it maps HF names to
        vLLM's fused parameters and keeps this rank's shard); returns {"loaded": how many tensors
        came, "attestation": the sync's combined digest of what this rank received and handed to
        `load_weights`, verified bucket by bucket}, or a failed sync's WeightSyncError as {"error":
        its fields} (vLLM's RPC would keep only its text). The digests cover the tensors as handed
        to vLLM's loader, not the fused, sharded and repacked parameters it makes of them, which the
        trainer cannot compute.

        The load is bracketed by vLLM's layerwise reload: after the first load vLLM post-processes
        weights into kernel-specific layouts (the CPU backend repacks linear weights, quantized
        models convert), so checkpoint-format tensors must be loaded into restored parameters and
        processed again, layer by layer, as they complete."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.model
        tied = getattr(self.model_config.hf_config.get_text_config(), "tie_word_embeddings", False)
        start = time.perf_counter()
        loaded = 0
        moe_layers: set[str] = set()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            try:
                for bucket in self._raytool_receiver.receive(version, timeout_s, attempt):
                    model.load_weights(bucket)
                    loaded += len(bucket)
                    moe_layers.update(name.split(".experts.")[0] for name, _ in bucket if ".experts." in name)
                    if tied:
                        _load_tied_lm_head(model, bucket)
            except WeightSyncError as exc:
                return {"error": exc.fields()}
            finally:
                finalize_layerwise_reload(model, self.model_config)
                repack_cpu_moe_experts(model, moe_layers)
        log.debug("weights v%d: %d tensors in %.2fs", version, loaded, time.perf_counter() - start)
        return {"loaded": loaded, "attestation": self._raytool_receiver.attestation}


def repack_cpu_moe_experts(model, moe_layers: set[str]) -> None:
    """vLLM 0.32 on a CPU: a weight update re-runs the MoE method's processing but not its experts'
    own hook, which is where the CPU kernel prepacks w13/w2 into its grouped-GEMM layout (the first
    load's `UnquantizedFusedMoEMethod._setup_kernel` calls it; an update's, with the kernel already
    set up, does not). Without this the kernel reads checkpoint-layout experts as if packed
    (measured on tiny-random-moe: log-probs off by 0.047 after reloading the very same weights).
    `moe_layers`: the prefixes (`model.layers.N.mlp`) whose experts this sync loaded; only those are
    packed (a second prepack of packed weights would scramble them)."""
    from vllm.platforms import current_platform

    if not moe_layers or not current_platform.is_cpu():
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight") and name.split(".experts")[0] in moe_layers:
            experts.process_weights_after_loading(module)


def _load_tied_lm_head(model, bucket) -> None:
    """A tied LM head gets the embedding matrix too. The model's `load_weights` skips the head of
    a tied model (at start-up the two share one parameter), but the layerwise reload restores the
    head as a layer of its own: without this it would keep serving the old weights (measured: a
    0.22 log-prob error after one perturbed update of a tied model)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "weight"):
        return
    for name, tensor in bucket:
        if name.endswith("embed_tokens.weight"):
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            loader = getattr(head.weight, "weight_loader", default_weight_loader)
            loader(head.weight, tensor)
