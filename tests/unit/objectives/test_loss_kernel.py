"""Which kernel computes the fused loss (issue 47): liger-kernel's fused linear
cross-entropy on CUDA where it imports and can give what autograd asks, Raylift's chunked
torch version everywhere else; `train.loss: liger` is refused before launch on CPU workers
and at model build where liger_kernel does not import; the planner counts liger's chunk.
liger-kernel is not installed here (CPU tests must not need it), so its own numbers are
gpu-check's (tools/gpucheck/loss.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support import small_model
from trainer.config import ConfigError, load_config
from trainer.errors import UserError
from trainer.objectives import linear_ce


def test_pick_kernel():
    pick = linear_ce.pick_kernel
    # (kernel, cuda, importable, weight gradient without the hidden states') -> kernel
    assert pick("auto", True, True, False) == "liger"
    assert pick("liger", True, True, False) == "liger"
    assert pick("chunked", True, True, False) == "chunked"  # ours, always
    for kernel in ("auto", "liger"):
        assert pick(kernel, False, True, False) == "chunked"  # not CUDA
        assert pick(kernel, True, False, False) == "chunked"  # not importable
        assert pick(kernel, True, True, True) == "chunked"  # liger 0.8.5 cannot
    with pytest.raises(ValueError, match="one of auto, chunked, liger"):
        pick("plain", True, True, False)


def test_a_cpu_head_runs_the_chunked_loss_without_importing_liger():
    """On CPU every setting computes the chunked loss (the same value as `chunked`), and
    liger_kernel (Triton) is never imported for it."""
    linear_ce.liger_importable.cache_clear()
    model = small_model.tiny_llama(1)
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(9))
    losses = {}
    for kernel in linear_ce.KERNELS:
        m = small_model.tiny_llama(1)
        assert linear_ce.install(m, chunk=4, kernel=kernel)
        assert m.lm_head.kernel == kernel
        losses[kernel] = m(input_ids=x, labels=x).loss
    assert losses["auto"] == losses["liger"] == losses["chunked"]
    assert torch.allclose(losses["auto"], model(input_ids=x, labels=x).loss, rtol=1e-5)
    # Never even asked for on CPU; and CPU tests do not need it.
    assert linear_ce.liger_importable.cache_info().currsize == 0
    assert "liger_kernel" not in sys.modules and not linear_ce.liger_importable()
    with pytest.raises(ValueError, match="loss kernel 'fused'"):
        linear_ce.install(small_model.tiny_llama(1), kernel="fused")


def test_liger_is_refused_where_it_cannot_run():
    with pytest.raises(UserError, match=r"^train.loss liger: liger_kernel does not import"):
        linear_ce.configure(small_model.tiny_llama(1), "liger")
    job = {
        "model": {"path": "/m"},
        "data": {"train_file": "t.jsonl"},
        "train": {"max_steps": 1, "loss": "liger"},
        "run": {"name": "x"},
    }
    with pytest.raises(ConfigError, match=r"train\.loss: liger runs liger-kernel.s Triton kernel"):
        load_config(job)
    job["scaling"] = {"use_gpu": True}
    assert load_config(job).train.loss == "liger"
