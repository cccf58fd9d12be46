"""The Tinker service's protobuf bodies against the `tinker` client's own encoder and decoders, and
its losses (raytool.algos.datum_losses) against their formulas and gradients. No server, no model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from raytool.algos.datum_losses import DATUM_LOSSES, get_datum_loss  # noqa: E402
from raytool.tinker.errors import Refused  # noqa: E402
from raytool.tinker.wire import decode_forward_backward, encode_forward_backward_output, encode_sample_response  # noqa: E402
from raytool.types import Datum  # noqa: E402


def _request(data, loss="ppo", config=None, forward_only=False) -> bytes:
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
                                       model_id="s:train:0", seq_id=3)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_a_forward_backward_request_decodes_as_the_client_encoded_it():
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-1.0, -2.0, -3.5], "advantages": [0.0, 1.0, -0.5]}),
            types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]), types.EncodedTextChunk(tokens=[2, 3])]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "logprobs": torch.tensor([-0.5, -0.25, -1.0]),
                                        "advantages": [1.0, 1.0, 1.0]})]
    req = decode_forward_backward(_request(data, config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, forward_only=True))
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("s:train:0", 3, "ppo", True)
    assert req.config == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert req.data == [Datum([5, 6, 7], [6, 7, 8], {"logprobs": [-1.0, -2.0, -3.5], "advantages": [0.0, 1.0, -0.5]}),
                        Datum([1, 2, 3], [2, 3, 4], {"logprobs": [-0.5, -0.25, -1.0], "advantages": [1.0, 1.0, 1.0]})]


def test_what_the_service_cannot_take_is_refused_naming_the_datum():
    unequal = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7]})
    with pytest.raises(Refused, match=r"datum 0: loss_fn_inputs\['target_tokens'\] has 2 values for 3 model_input tokens"):
        decode_forward_backward(_request([unequal], "cross_entropy"))
    no_targets = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"weights": [1.0, 1.0]})
    ok = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7]})
    with pytest.raises(Refused, match=r"datum 1: loss_fn_inputs has no 'target_tokens'"):
        decode_forward_backward(_request([ok, no_targets], "cross_entropy"))
    top_k = types.Datum(model_input=types.ModelInput.from_ints([5, 6]),
                        loss_fn_inputs={"target_tokens": torch.tensor([[6, 1], [7, 2]]), "weights": torch.tensor([[0.5, 0.5], [0.5, 0.5]])})
    with pytest.raises(Refused, match=r"datum 0: loss_fn_inputs\['target_tokens'\] is a sparse 2-D tensor|shape \[2, 2\]"):
        decode_forward_backward(_request([top_k], "cross_entropy"))
    with pytest.raises(Refused, match="not a ForwardBackwardRequest protobuf"):
        decode_forward_backward(b"\xff\xff\xff")


def test_outputs_decode_with_the_clients_own_decoders():
    out = deserialize_forward_backward_output(encode_forward_backward_output([[-1.0, -2.5], [-0.5]], {"loss:sum": 4.0, "clip_fraction:mean": 0.25}))
    assert [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.5]]
    assert out.metrics == {"loss:sum": 4.0, "clip_fraction:mean": 0.25}
    res = deserialize_sample_response(encode_sample_response([([4, 5, 2], [-0.1, -0.2, -0.3], "stop"), ([9], [-1.5], "length")],
                                                             [math.nan, -3.0, -4.0]))
    assert [(s.tokens, s.stop_reason) for s in res.sequences] == [([4, 5, 2], "stop"), ([9], "length")]
    assert res.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert res.prompt_logprobs == [None, -3.0, -4.0]


def _grad(loss, logp, inputs, **config):
    logp = logp.clone().requires_grad_(True)
    value, metrics = get_datum_loss(loss)(logp, inputs, torch.ones_like(logp), **config)
    value.backward()
    return value.item(), logp.grad, metrics


def test_the_losses_are_sums_with_their_documented_gradients():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    sampled = torch.tensor([[-1.0, -1.0, -1.0, -3.5]])
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    weights = torch.tensor([[0.0, 1.0, 1.0, 2.0]])
    value, grad, _ = _grad("cross_entropy", logp, {"weights": weights})
    assert value == pytest.approx(2.0 + 0.5 + 6.0) and torch.equal(grad, -weights)
    ratio = torch.exp(logp - sampled)
    value, grad, _ = _grad("importance_sampling", logp, {"logprobs": sampled, "advantages": adv})
    assert value == pytest.approx(float(-(ratio * adv).sum())) and torch.allclose(grad, -ratio * adv)
    # ppo: a ratio outside [0.9, 1.1] on the side the advantage pushes has no gradient
    value, grad, metrics = _grad("ppo", logp, {"logprobs": sampled, "advantages": adv}, clip_low_threshold=0.9, clip_high_threshold=1.1)
    clipped = torch.clamp(ratio, 0.9, 1.1)
    assert value == pytest.approx(float(-torch.minimum(ratio * adv, clipped * adv).sum()))
    assert grad[0, 0] == pytest.approx(-1.0) and grad[0, 2] == 0.0  # ratio 1 (inside); ratio e^0.5 with A>0 (clipped)
    assert metrics["clip_fraction"].item() == pytest.approx(0.75)
    # cispo: the clipped ratio is a constant weight, every token keeps the gradient of its log-prob
    value, grad, _ = _grad("cispo", logp, {"logprobs": sampled, "advantages": adv})
    assert torch.allclose(grad, -torch.clamp(ratio, 0.8, 1.2) * adv)
    value, grad, _ = _grad("dro", logp, {"logprobs": sampled, "advantages": adv}, beta=0.5)
    assert torch.allclose(grad, -(adv - 0.5 * (logp - sampled)))
    with pytest.raises(ValueError, match=r"loss 'dro' needs loss_fn_config\['beta'\]"):
        _grad("dro", logp, {"logprobs": sampled, "advantages": adv})
    assert sorted(DATUM_LOSSES) == ["cispo", "cross_entropy", "dro", "importance_sampling", "ppo"]
    for fn in DATUM_LOSSES.values():
        assert fn.__doc__ and isinstance(fn.inputs, tuple) and isinstance(fn.config, dict) and isinstance(fn.fill, dict)
