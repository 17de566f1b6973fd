"""One model in memory: the precomputed reference and the adapter-off reference give the
log-probs (and so the loss) a live second reference model gives."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from tests.support.preference import write_pairs
from trainer.config import load_config
from trainer.data.tokenize import Settings, prepare
from trainer.objectives.losses import sequence_logps
from trainer.objectives.pairs import PairBlocks, data_options
from trainer.objectives.reference import ensure_reference
from trainer.strategies.base import ModelSource, build_strategy


def _setup(tiny, tmp: Path, adapter: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(
        {
            "model": {"path": str(tiny["model"]), "adapter": adapter},
            "data": {"train_file": str(write_pairs(tmp / "p.jsonl", 10)), "block_size": 40},
            "train": {"objective": "dpo", "max_steps": 1, "micro_batch_size": 3},
            "scaling": {"num_workers": 1},
            "run": {"name": "ref"},
        }
    )
    tok = AutoTokenizer.from_pretrained(str(tiny["model"]))
    opts = data_options(cfg, Settings(block_size=40))
    cache = prepare(cfg.data.train_file, tok, cache_root=str(tmp / "c"), progress=False, **opts)
    strategy = build_strategy(cfg, torch.device("cpu"), 0, 1)
    strategy.setup(ModelSource(Path(tiny["model"]), len(tok)))
    live = AutoModelForCausalLM.from_pretrained(str(tiny["model"])).float().eval()
    return cfg, PairBlocks(cache, 40), strategy, live


def _live_logps(live, ids, labels) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logps(
            live(input_ids=torch.from_numpy(ids)).logits, torch.from_numpy(labels)
        )[0]


def _loss(strategy, x, y, ref) -> float:
    n = torch.tensor(float(len(x) // 2))
    with torch.no_grad():
        return float(strategy.objective.loss(strategy.model, x, y, n, ref=ref))


def test_precomputed_reference_is_the_live_reference(tiny, tmp_path: Path) -> None:
    cfg, pairs, strategy, live = _setup(tiny, tmp_path, "none")
    rt = SimpleNamespace(
        rank=0, world_size=1, barrier=lambda: None, run=SimpleNamespace(uri=str(tmp_path))
    )
    ensure_reference(cfg, strategy, pairs, rt)
    ids, labels = pairs.blocks.gather(np.arange(len(pairs) * 2))
    expected = _live_logps(live, ids, labels).double().numpy()
    np.testing.assert_allclose(pairs.reference, expected, rtol=1e-5)
    stored = next(pairs.cache.dir.glob("reference-*/logps.npy"))
    # A train step later the model is no longer the reference: the stored column is read,
    # never recomputed (a resume or a resubmission).
    with torch.no_grad():
        next(strategy.model.parameters()).add_(0.5)
    again = PairBlocks(pairs.cache, 40)
    ensure_reference(cfg, strategy, again, rt)
    np.testing.assert_array_equal(again.reference, pairs.reference)
    assert stored.exists() and not list(stored.parent.glob("part-*"))
    # The loss with the column is the loss with a live reference model's log-probs.
    ix = np.array([3, 0, 7])
    ids, labels, ref = again.gather(ix)
    x, y = torch.from_numpy(ids), torch.from_numpy(labels)
    live_ref = _live_logps(live, ids, labels)
    assert _loss(strategy, x, y, torch.from_numpy(ref)) == _loss(strategy, x, y, live_ref.double())


def test_adapter_off_reference_is_the_base_model(tiny, tmp_path: Path) -> None:
    _, pairs, strategy, live = _setup(tiny, tmp_path, "lora")
    with torch.no_grad():  # a trained adapter: the policy is no longer the base
        for name, p in strategy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids, labels, _ = pairs.gather(np.array([1, 5]))
    x, y = torch.from_numpy(ids), torch.from_numpy(labels)
    objective = strategy.objective
    assert objective.adapter_reference and not objective.column_reference
    ref = objective.reference_logps(strategy.model, x, y, None)
    base = _live_logps(live, ids, labels)
    torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        policy = sequence_logps(strategy.model(input_ids=x).logits, y)[0]
    assert (policy - base).abs().max() > 1e-2  # the adapter is back on after the reference
    assert _loss(strategy, x, y, None) == _loss(strategy, x, y, base)
