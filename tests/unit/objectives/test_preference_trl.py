"""Raylift's preference losses against TRL itself (test-only oracle, trl in the dev extra).

On one tiny Llama, one batch of pairs and one reference, each objective's loss and every
parameter's gradient must match TRL's to 1e-5 relative, on CPU. DPO and hinge run through
TRL's DPOTrainer loss (its fused LM head, with precomputed reference log-probs); IPO too
(TRL's per-token normalisation); SimPO's and ORPO's formulas are TRL's CPOTrainer.cpo_loss
and ORPOTrainer.odds_ratio_loss, over log-probs from TRL's get_batch_logps.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support.small_model import tiny_llama
from trainer.config import load_config
from trainer.data.tokenize import IGNORE
from trainer.objectives import build_objective, losses

BLOCK, VOCAB = 20, 64
PAIRS = [  # (prompt length, chosen length, rejected length)
    (5, 7, 4),
    (3, 9, 9),
    (8, 2, 6),
]


def _cfg(objective: str, adapter: str = "none", **pref):
    return load_config(
        {
            "model": {"path": "unused", "adapter": adapter},
            "data": {"train_file": "unused.jsonl", "block_size": BLOCK},
            "train": {"objective": objective, "max_steps": 1, "preference": pref},
            "scaling": {"num_workers": 1},
            "run": {"name": "pref"},
        }
    )


def _model(seed: int) -> torch.nn.Module:
    return tiny_llama(seed, VOCAB)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, completion mask): chosen rows, then rejected, right-padded."""
    g = torch.Generator().manual_seed(7)
    n = len(PAIRS)
    ids = torch.zeros((2 * n, BLOCK), dtype=torch.long)
    mask = torch.zeros((2 * n, BLOCK), dtype=torch.long)
    for i, (p, c, r) in enumerate(PAIRS):
        prompt = torch.randint(1, VOCAB, (p,), generator=g)
        for row, length in ((i, c), (n + i, r)):
            ids[row, :p] = prompt
            ids[row, p : p + length] = torch.randint(1, VOCAB, (length,), generator=g)
            mask[row, p : p + length] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    return ids, labels, mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= rel * scale, (a, b)


def _compare(ours: tuple, theirs: tuple) -> None:
    loss_a, grads_a = ours
    loss_b, grads_b = theirs
    _close(loss_a.detach(), loss_b.detach())
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        _close(grads_a[name], grads_b[name])


def _raylift(objective: str, model, ids, labels, ref=None, **pref):
    obj = build_objective(_cfg(objective, **pref))
    model.zero_grad()
    loss = obj.loss(model, ids, labels, torch.tensor(float(len(PAIRS))), ref=ref)
    loss.backward()
    return loss, _grads(model), obj


def _reference(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return losses.sequence_logps(_model(1)(input_ids=ids).logits, labels)[0]


def _trl_dpo(loss_type: str, model, ids, mask, ref):
    """TRL's DPOTrainer._compute_loss, on a stand-in trainer holding only what it reads."""
    from accelerate import Accelerator
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    n = len(PAIRS)
    trainer = SimpleNamespace(
        model=model,
        accelerator=Accelerator(cpu=True),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=0.1,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "ref_chosen_logps": ref[:n],
        "ref_rejected_logps": ref[n:],
    }
    model.zero_grad()
    loss = DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    return loss, _grads(model), trainer._metrics["train"]


@pytest.mark.parametrize(
    ("ours", "theirs"), [("dpo", "sigmoid"), ("hinge", "hinge"), ("ipo", "ipo")]
)
def test_reference_losses_match_trl_dpo(ours: str, theirs: str) -> None:
    ids, labels, mask = _batch()
    ref = _reference(ids, labels)
    model = _model(0)
    ray = _raylift(ours, model, ids, labels, ref)
    trl_loss, trl_grads, metrics = _trl_dpo(theirs, copy.deepcopy(model), ids, mask, ref)
    _compare(ray[:2], (trl_loss, trl_grads))
    # TRL's metrics, by TRL's names, from the same pairs.
    ours_metrics = ray[2].metrics(lambda values: values)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours_metrics[name] == pytest.approx(metrics[name][0], rel=1e-5, abs=1e-7), name
    for name in ("logps/chosen", "logps/rejected"):
        assert ours_metrics[name] == pytest.approx(metrics[name][0], rel=1e-5), name


def _trl_logps(model, ids, labels, average: bool) -> torch.Tensor:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    logits = model(input_ids=ids).logits
    return CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)


def _stand_in(**kw):
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), alpha=0.0, **kw)


def test_simpo_matches_trl_cpo() -> None:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    ids, labels, _ = _batch()
    model = _model(0)
    ray = _raylift("simpo", model, ids, labels)
    model.zero_grad()
    n = len(PAIRS)
    avg = _trl_logps(model, ids, labels, True)
    trl_losses, _, _ = CPOTrainer.cpo_loss(
        _stand_in(loss_type="simpo", beta=2.0, simpo_gamma=1.0, label_smoothing=0.0),
        avg[:n],
        avg[n:],
    )
    trl_loss = trl_losses.mean()  # cpo_alpha 0: SimPO has no NLL term
    trl_loss.backward()
    _compare(ray[:2], (trl_loss, _grads(model)))


def test_orpo_matches_trl() -> None:
    """ORPO's odds-ratio term is TRL's; its NLL is each chosen completion's token mean,
    averaged over pairs (TRL takes one token mean over the batch's chosen rows, prompts
    included: docs/preference.md says why Raylift does not)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    ids, labels, _ = _batch()
    model = _model(0)
    ray = _raylift("orpo", model, ids, labels)
    model.zero_grad()
    n = len(PAIRS)
    logits = model(input_ids=ids).logits
    avg = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    ratio_losses, *_ = ORPOTrainer.odds_ratio_loss(_stand_in(beta=0.1), avg[:n], avg[n:])
    nll = torch.stack(
        [F.cross_entropy(logits[i, :-1], labels[i, 1:], ignore_index=IGNORE) for i in range(n)]
    ).mean()
    trl_loss = nll - ratio_losses.mean()
    trl_loss.backward()
    _compare(ray[:2], (trl_loss, _grads(model)))


def test_sequence_logps_match_trl() -> None:
    ids, labels, _ = _batch()
    model = _model(0)
    with torch.no_grad():
        ours, count = losses.sequence_logps(model(input_ids=ids).logits, labels)
        theirs = _trl_logps(model, ids, labels, False)
    _close(ours, theirs)
    assert count.tolist() == [c for _, c, _ in PAIRS] + [r for _, _, r in PAIRS]


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_micro_batches_add_up_to_the_batch(objective: str) -> None:
    """Each micro batch's loss is its pairs' sum over the step's pair count, so split
    micro batches (gradient accumulation, or ranks) give the whole batch's loss and grads."""
    ids, labels, _ = _batch()
    ref = _reference(ids, labels)
    model = _model(0)
    whole = _raylift(objective, model, ids, labels, ref)
    obj = build_objective(_cfg(objective))
    model.zero_grad()
    n, total = len(PAIRS), torch.tensor(float(len(PAIRS)))
    loss = torch.zeros(())
    for part in ([0], [1, 2]):
        rows = torch.tensor(part + [n + i for i in part])
        micro = obj.loss(model, ids[rows], labels[rows], total, ref=ref[rows])
        micro.backward()
        loss += micro.detach()
    _compare(whole[:2], (loss, _grads(model)))
