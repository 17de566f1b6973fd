"""Dense families are unchanged by the mixture-of-experts work: Qwen2, Mistral, Gemma 2
and Phi-3 under FSDP2 (meta skeleton, the checkpoint layout conversion, decoder layers as
units), full and LoRA with no setting, give DDP's loss and every gradient within 1e-5 on
one rank. (DDP and LoRA train and export per family in test_families.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.families import build_family
from trainer.config import load_config
from trainer.strategies.base import ModelSource, build_strategy

DENSE = ("qwen2", "mistral", "gemma2", "phi3")


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {f: build_family(root / f, f, tiny["model"]) for f in DENSE}


def _step(model_dir: Path, strategy: str, adapter: str) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = load_config(
        {
            "model": {"path": str(model_dir), "adapter": adapter},
            "data": {"train_file": "unused.jsonl", "block_size": 16},
            "train": {"micro_batch_size": 2, "max_steps": 1},
            "strategy": {"name": strategy},
            "scaling": {"num_workers": 1},
            "run": {"name": "dense"},
        }
    )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(model_dir, vocab))
    s.model.train()
    x = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(5))
    y = x.clone()
    y[:, :3] = -100
    n = torch.tensor(float((y[:, 1:] != -100).sum()))
    with s.accumulating(True):
        loss = float(s.train_micro(x, y, n))
    grads = {}
    for name, p in s.model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return loss, grads


@pytest.mark.parametrize("family", DENSE)
def test_fsdp2_full_and_lora_give_ddps_loss_and_gradients(family, folders):
    from torch.distributed.fsdp import FSDPModule

    for adapter in ("none", "lora"):
        want_loss, want = _step(folders[family], "ddp", adapter)
        got_loss, got = _step(folders[family], "fsdp", adapter)
        assert abs(got_loss - want_loss) < 1e-5, (family, adapter, got_loss, want_loss)
        assert sorted(got) == sorted(want), (family, adapter)
        for name, g in want.items():
            diff = float((got[name] - g).abs().max())
            assert diff < 1e-5, (family, adapter, name, diff)
        assert any(float(g.abs().sum()) > 0 for g in want.values())
    # The units: each decoder layer whole (as for the mixture-of-experts models).
    cfg_dir = folders[family]
    s = build_strategy(
        load_config(
            {
                "model": {"path": str(cfg_dir)},
                "data": {"train_file": "unused.jsonl", "block_size": 16},
                "strategy": {"name": "fsdp"},
                "scaling": {"num_workers": 1},
                "run": {"name": "dense"},
            }
        ),
        torch.device("cpu"),
        0,
        1,
    )
    s.setup(ModelSource(cfg_dir, json.loads((cfg_dir / "config.json").read_text())["vocab_size"]))
    units = [n for n, m in s.model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "model.layers.0", "model.layers.1"], units
