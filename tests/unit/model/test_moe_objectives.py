"""The router's aux loss in the preference and RL objectives: a mixture-of-experts model's
trained forwards add coef × transformers' own aux loss (weighed by the micro batch's share
of the step), once, and `aux_loss` is reported apart; no-grad forwards (KTO's mismatched
rows) add nothing, and a dense model's losses and metrics are unchanged."""

from __future__ import annotations

import pytest
import torch

from tests.unit.model.test_moe_lora import tiny_moe
from trainer.config import load_config
from trainer.objectives import build_objective
from trainer.objectives.grpo import count_items

COEF = 0.1  # large enough to see in the sum


def _cfg(objective: str, **train: object):
    return load_config(
        {
            "model": {"path": "unused"},
            "data": {"train_file": "p.jsonl", "block_size": 12},
            "train": {"objective": objective, "max_steps": 1, "micro_batch_size": 2, **train},
            "scaling": {"num_workers": 1},
            "run": {"name": "moe-objectives"},
        }
    )


def _model(coef: float) -> torch.nn.Module:
    model = tiny_moe("qwen3_moe")
    model.config.router_aux_loss_coef = coef
    model.router_aux_loss_coef = coef
    return model


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (n, 12), generator=gen)
    y = x.clone()
    y[:, :4] = -100  # the prompt
    return x, y


def _theirs(x: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    out = _model(COEF)(input_ids=x, attention_mask=mask, output_router_logits=True)
    return float(out.aux_loss)


def _identity(values: list[float]) -> list[float]:
    return values


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_a_preference_loss_adds_the_aux_loss_of_its_pairs_forward(objective):
    x, y = _rows(4, 0)  # 2 pairs: chosen rows first
    on, off = build_objective(_cfg(objective)), build_objective(_cfg(objective))
    with_aux = on.loss(_model(COEF), x, y, torch.tensor(4.0))  # 2 of the step's 4 pairs
    without = off.loss(_model(0.0), x, y, torch.tensor(4.0))
    aux = _theirs(x)
    assert aux > 0.5
    assert float(with_aux - without) == pytest.approx(COEF * aux * 2 / 4, rel=1e-5)
    got, plain = on.metrics(_identity), off.metrics(_identity)
    assert got["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert plain["aux_loss"] == pytest.approx(aux, rel=1e-6)  # coef 0: still reported
    assert got == pytest.approx(plain, abs=1e-4)  # the pairs' metrics are the loss's own


def test_kto_adds_the_aux_loss_of_its_trained_rows_only():
    x, y = _rows(4, 1)  # 2 rows, then their 2 mismatched sequences (no grad: KL only)
    ref = torch.zeros(4)
    good = torch.tensor([1, 0])
    on, off = build_objective(_cfg("kto")), build_objective(_cfg("kto"))
    with_aux = on.loss(_model(COEF), x, y, torch.tensor(2.0), desirable=good, ref=ref)
    without = off.loss(_model(0.0), x, y, torch.tensor(2.0), desirable=good, ref=ref)
    aux = _theirs(x[:2])
    assert float(with_aux - without) == pytest.approx(COEF * aux, rel=1e-5)
    assert abs(aux - _theirs(x)) > 1e-4  # the mismatched rows would change it
    assert on.metrics(_identity)["aux_loss"] == pytest.approx(aux, rel=1e-6)


def test_grpo_adds_the_aux_loss_of_its_unpadded_tokens():
    cfg = _cfg(
        "grpo",
        rl={"rewards": [{"function": "math_answer"}], "num_generations": 2, "beta": 0.0},
    )
    x, _ = _rows(2, 2)
    attention = torch.ones_like(x)
    attention[0, :3] = 0  # a left-padded prompt
    mask = torch.zeros(2, 5, dtype=torch.long)
    mask[:, :4] = 1  # each completion's tokens (the last 5 positions, 4 of them kept)
    kw = {"attention": attention, "advantages": torch.tensor([1.0, -1.0])}
    on, off = build_objective(cfg), build_objective(cfg)
    n = torch.tensor(count_items(on.s.loss_type, mask))  # the step is this micro batch
    with_aux = on.loss(_model(COEF), x, mask, n, **kw)
    without = off.loss(_model(0.0), x, mask, n, **kw)
    aux = _theirs(x, attention)
    assert abs(aux - _theirs(x)) > 1e-4  # the pads would change it
    assert float(with_aux - without) == pytest.approx(COEF * aux, rel=1e-5)
    assert on._sums is not None and on.router.metrics(_identity)["aux_loss"] == pytest.approx(
        aux, rel=1e-6
    )


def test_a_dense_model_adds_nothing_and_reports_no_aux_loss():
    from tests.support.small_model import tiny_llama

    x, y = _rows(4, 3)
    model = tiny_llama(0, vocab=64)
    obj = build_objective(_cfg("simpo"))
    loss = obj.loss(model, x, y, torch.tensor(2.0))
    assert loss.requires_grad
    assert "aux_loss" not in obj.metrics(_identity)
