"""FSDP's mesh-aware clipping (trainer.strategies.mesh_state.clip_grad_norm_mesh) keeps its norm
on the device (issue 47: the step report reads it when it writes a record) and scales the
gradients exactly as the host's float coefficient did."""

from __future__ import annotations

import math

import torch

from trainer.strategies.mesh_state import clip_grad_norm_mesh


def _params(scale: float) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 33, 129)]
    for p in params:
        p.grad = torch.randn_like(p) * scale
    return params


def _host(params: list[torch.nn.Parameter], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """What the clipping did when it read the norm on the host."""
    sq = sum(p.grad.double().pow(2).sum() for p in params)
    norm = math.sqrt(float(sq))
    coef = max_norm / (norm + 1e-6)
    return norm, [p.grad * coef if coef < 1.0 else p.grad.clone() for p in params]


def test_the_norm_stays_a_tensor_and_the_gradients_match_the_host_formula():
    for scale, max_norm in ((10.0, 1.0), (1e-3, 1.0)):  # clipped, and left alone
        params = _params(scale)
        want_norm, want = _host(params, max_norm)
        norm = clip_grad_norm_mesh(params, max_norm, replicas=1)
        assert torch.is_tensor(norm) and norm.item() == want_norm
        for p, w in zip(params, want, strict=True):
            assert torch.equal(p.grad, w)


def test_a_nan_norm_leaves_the_gradients_as_they_were():
    params = _params(1.0)
    params[0].grad[3] = float("nan")
    before = [p.grad.clone() for p in params]
    assert math.isnan(clip_grad_norm_mesh(params, 1.0, replicas=1).item())
    for p, b in zip(params[1:], before[1:], strict=True):
        assert torch.equal(p.grad, b)
