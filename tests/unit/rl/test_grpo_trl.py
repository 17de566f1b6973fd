"""Raylift's GRPO and RLOO losses against TRL's own trainers (the oracle, TRL 1.16).

For one fixed batch of prompts, completions and advantages on a tiny Llama, the loss and
every parameter's gradient match `GRPOTrainer._compute_loss` for each loss_type, and
`RLOOTrainer._compute_loss`, within 1e-5 relative: with old log-probs from another
policy (num_iterations 2: some ratios clipped), with a reference and beta 0.04, at a
sampling temperature, and split into micro batches as gradient accumulation splits them.
TRL's first-step loss is about 0, so the gradients are what is compared.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.rl_batch import VOCAB, grpo_stand_in, rl_batch, rloo_stand_in
from tests.support.small_model import tiny_llama
from trainer.config import load_config
from trainer.objectives.grpo import LossSettings, count_items, policy_loss
from trainer.rollouts.logps import completion_logps

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo"]
ADVANTAGES = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3], dtype=torch.float64)


def _settings(objective: str = "grpo", **rl) -> LossSettings:
    cfg = load_config(
        {
            "model": {"path": "unused"},
            "data": {"train_file": "p.jsonl", "block_size": 32},
            "train": {
                "objective": objective,
                "micro_batch_size": 6,
                "max_steps": 1,
                "rl": {"rewards": [{"function": "math_answer"}], "num_generations": 2, **rl},
            },
            "scaling": {"num_workers": 1},
            "run": {"name": "rl"},
        }
    )
    return LossSettings.of(cfg)


def _model(seed: int) -> torch.nn.Module:
    """The tiny Llama in float64: the losses are sums of terms of either sign that
    cancel to near 0, so float32's rounding alone would be 1e-5 of them."""
    return tiny_llama(seed, VOCAB).double()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= rel * scale, (float((a - b).abs().max()), scale)


def _compare(ours: tuple, theirs: tuple) -> None:
    _close(ours[0].detach(), theirs[0].detach())
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name in ours[1]:
        _close(ours[1][name], theirs[1][name])
    assert max(float(g.abs().max()) for g in ours[1].values()) > 1e-4  # a gradient to compare


def _logps(model, b, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return completion_logps(model, b.ids, b.attention, b.completion_ids.size(1), temperature)[0]


def _old_and_ref(temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling-time log-probs of a policy one update away (the policy's own, moved by
    up to ±0.4 nats: num_iterations 2's second pass, some ratios outside the clip), and a
    reference model's."""
    b = rl_batch()
    own = _logps(_model(0), b, temperature)
    shift = (torch.rand(own.shape, generator=torch.Generator().manual_seed(3)) - 0.5) * 0.8
    old = (own + shift) * b.completion_mask
    return old, _logps(_model(1), b, temperature)


def _ours(s: LossSettings, parts: list[list[int]], old, ref, advantages=ADVANTAGES):
    """Raylift's micro batches over `parts`, each loss over the step's divisor."""
    b, model = rl_batch(), _model(0)
    total = sum(count_items(s.loss_type, b.completion_mask[p].numpy()) for p in parts)
    loss = torch.zeros((), dtype=torch.float64)
    for p in parts:
        m = b.rows(p)
        logps, _ = completion_logps(
            model, m.ids, m.attention, m.completion_ids.size(1), s.temperature
        )
        micro, _ = policy_loss(
            s,
            logps,
            m.completion_mask,
            advantages[p],
            None if old is None else old[p],
            None if ref is None else ref[p],
            torch.tensor(total),
        )
        micro.backward()
        loss += micro.detach()
    return loss, _grads(model)


def _trl_grpo(s: LossSettings, parts: list[list[int]], old, ref):
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    b, model = rl_batch(), _model(0)
    add_fused_lm_head(model, temperature=s.temperature, outputs=("log_probs", "entropy"))
    trainer = grpo_stand_in(
        model,
        s.loss_type,
        s.beta,
        accum=len(parts),
        max_len=s.max_completion_length,
        epsilon=s.epsilon_low,
        epsilon_high=s.epsilon_high,
    )
    loss = torch.zeros((), dtype=torch.float64)
    for p in parts:
        m = b.rows(p)
        inputs = {
            "prompt_ids": m.prompt_ids,
            "prompt_mask": m.prompt_mask,
            "completion_ids": m.completion_ids,
            "completion_mask": m.completion_mask,
            "advantages": ADVANTAGES[p],
            "num_items_in_batch": b.completion_mask.sum(),
        }
        if old is not None:
            inputs["old_per_token_logps"] = old[p]
        if ref is not None:
            inputs["ref_per_token_logps"] = ref[p]
        micro = GRPOTrainer._compute_loss(trainer, model, inputs)
        micro.backward()
        loss += micro.detach()
    return loss, _grads(model)


WHOLE = [[0, 1, 2, 3, 4, 5]]
SPLIT = [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_first_pass_matches_trl(loss_type: str) -> None:
    """num_iterations 1, beta 0 (TRL's defaults): the ratio is 1, the loss about 0."""
    s = _settings(loss_type=loss_type, max_completion_length=7)
    _compare(_ours(s, WHOLE, None, None), _trl_grpo(s, WHOLE, None, None))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_old_logps_reference_and_temperature_match_trl(loss_type: str) -> None:
    s = _settings(
        loss_type=loss_type,
        beta=0.04,
        num_iterations=2,
        temperature=0.7,
        epsilon_high=0.28,
        max_completion_length=7,
    )
    old, ref = _old_and_ref(0.7)
    ours = _ours(s, WHOLE, old, ref)
    _compare(ours, _trl_grpo(s, WHOLE, old, ref))
    assert abs(float(ours[0])) > 1e-3  # off-policy and KL: a loss that is not 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_match_trl_accumulation(loss_type: str) -> None:
    """Two micro batches of one step (gradient accumulation 2) give TRL's step."""
    s = _settings(loss_type=loss_type, beta=0.04, num_iterations=2, max_completion_length=7)
    old, ref = _old_and_ref(1.0)
    _compare(_ours(s, SPLIT, old, ref), _trl_grpo(s, SPLIT, old, ref))


def test_rloo_matches_trl() -> None:
    from trl import RLOOTrainer
    from trl.trainer.utils import add_fused_lm_head

    s = _settings("rloo", num_iterations=2)
    old, _ = _old_and_ref(1.0)
    b = rl_batch()
    old_seq = (old * b.completion_mask).sum(1)
    ours = _ours(s, SPLIT, old_seq, None)
    model = _model(0)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    trainer = rloo_stand_in(model)
    loss = torch.zeros((), dtype=torch.float64)
    for p in SPLIT:
        m = b.rows(p)
        inputs = {
            "prompt_ids": m.prompt_ids,
            "prompt_mask": m.prompt_mask,
            "completion_ids": m.completion_ids,
            "completion_mask": m.completion_mask,
            "advantages": ADVANTAGES[p],
            "old_logps": old_seq[p],
        }
        micro = RLOOTrainer._compute_loss(trainer, model, inputs) / len(SPLIT)  # HF's accumulation
        micro.backward()
        loss += micro.detach()
    _compare(ours, (loss, _grads(model)))
    assert abs(float(ours[0])) > 1e-3


def test_loss_type_normalisations_differ() -> None:
    """The four loss types are four different gradients here (the comparison above
    would not notice a loss type ignored)."""
    old, ref = _old_and_ref(1.0)
    grads = [
        _ours(_settings(loss_type=t, max_completion_length=7), SPLIT, old, ref)[1]["lm_head.weight"]
        for t in LOSS_TYPES
    ]
    for i in range(len(grads)):
        for j in range(i + 1, len(grads)):
            assert not torch.allclose(grads[i], grads[j], rtol=1e-3), (LOSS_TYPES[i], LOSS_TYPES[j])
