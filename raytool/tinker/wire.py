"""The Tinker API's protobuf bodies (the `tinker` package's own schema, `tinker_public.proto`): a
forward_backward request in, a ForwardBackwardOutput and a SampleResponse out. Everything else on
the wire is JSON."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from raytool.tinker.errors import Refused
from raytool.types import Datum

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32, pb.DTYPE_BFLOAT16: np.uint16}


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict
    forward_only: bool
    data: list[Datum]


def _array(name: str, row: int, msg: pb.Tensor) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise Refused(f"datum {row}: loss_fn_inputs['{name}'] is a sparse 2-D tensor (several targets per position); "
                      "raytool serves one target per position: send a dense 1-D tensor")
    kind = _DTYPES.get(msg.dtype)
    if kind is None:
        raise Refused(f"datum {row}: loss_fn_inputs['{name}'] has dtype {pb.DType.Name(msg.dtype)}; expected float32 or int64")
    values = np.frombuffer(msg.dense, dtype=kind)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    if len(msg.shape) > 1:
        raise Refused(f"datum {row}: loss_fn_inputs['{name}'] has shape {list(msg.shape)}; raytool serves 1-D per-position inputs")
    return values


def _tokens(row: int, datum: pb.Datum) -> list[int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise Refused(f"datum {row}: a model_input chunk of kind '{kind}'; raytool serves text models (encoded text chunks)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """A forward_backward (or forward) request; tensors of unequal lengths, an input the service
    cannot take and a missing `target_tokens` are refused naming the datum and the input."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - the protobuf runtime's DecodeError
        raise Refused(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict = {k: v.number if v.WhichOneof("value") == "number" else v.text for k, v in msg.loss_fn_config_v2.items()}
    for k, v in msg.loss_fn_config.items():
        config.setdefault(k, v)
    data = []
    for row, datum in enumerate(msg.data):
        tokens = _tokens(row, datum)
        if not tokens:
            raise Refused(f"datum {row}: model_input holds no tokens")
        arrays = {name: _array(name, row, tensor) for name, tensor in datum.loss_fn_inputs.items()}
        if "target_tokens" not in arrays:
            raise Refused(f"datum {row}: loss_fn_inputs has no 'target_tokens' (it has {sorted(arrays)})")
        for name, values in arrays.items():
            if len(values) != len(tokens):
                raise Refused(f"datum {row}: loss_fn_inputs['{name}'] has {len(values)} values for {len(tokens)} model_input tokens; "
                              "every input has one value per position")
        targets = arrays.pop("target_tokens").astype(np.int64).tolist()
        data.append(Datum(tokens=tokens, targets=targets, inputs={k: v.astype(np.float32).tolist() for k, v in arrays.items()}))
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """Each datum's log-probs of its targets as one batched float32 record, and the metrics."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = np.concatenate([np.asarray(row, dtype=np.float32) for row in logprobs]).tobytes() if logprobs else b""
    field.offsets = (np.cumsum([0] + [len(row) for row in logprobs]) * 4).astype(np.int64).tobytes()
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None = None) -> bytes:
    """`sequences`: (tokens, their log-probs, "stop" or "length"); `prompt_logprobs`: one per
    prompt token, NaN where none is computed (the first)."""
    out = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
