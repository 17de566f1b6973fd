"""The router's load-balancing loss of a mixture-of-experts model is on by default, added
to the loss the strategies backpropagate exactly once, weighed by each micro batch's share
of the step's targets, and reported apart as `aux_loss`; checked against transformers'
own loss (the model's forward with output_router_logits) on tiny random models."""

from __future__ import annotations

import pytest
import torch

from tests.unit.model.test_moe_lora import lora_cfg, tiny_moe
from trainer.objectives.sft import SFT, RouterAux

IGNORE = -100


def batch(seed: int, masked: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 12), generator=gen)
    y = x.clone()
    y[:, :masked] = IGNORE  # a prompt: fewer targets than tokens
    return x, y


def identity(values: list[float]) -> list[float]:
    return values


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_one_batch_loss_is_transformers_loss_with_its_aux_loss(kind):
    model = tiny_moe(kind)
    model.config.router_aux_loss_coef = 0.1  # large enough to see in the sum
    model.router_aux_loss_coef = 0.1
    sft = SFT(lora_cfg())
    x, y = batch(0, 3)
    ours = sft.loss(model, x, y, None)
    theirs = model(input_ids=x, labels=y, output_router_logits=True)
    lm_only = model(input_ids=x, labels=y).loss
    assert torch.allclose(ours, theirs.loss, atol=1e-6)
    assert float(ours - lm_only) == pytest.approx(0.1 * float(theirs.aux_loss), rel=1e-5)
    assert float(theirs.aux_loss) > 0.5  # ~1 for a balanced router: not a zero
    assert sft.metrics(identity) == pytest.approx({"aux_loss": float(theirs.aux_loss)})


def test_aux_loss_is_added_once_when_the_config_already_asks_for_router_logits():
    model = tiny_moe("qwen3_moe")
    model.config.output_router_logits = True  # the model would add it itself
    x, y = batch(1, 0)
    ours = SFT(lora_cfg()).loss(model, x, y, None)
    theirs = model(input_ids=x, labels=y)  # the config's output_router_logits: aux once
    assert torch.allclose(ours, theirs.loss, atol=1e-6)


def test_accumulated_micro_batches_weigh_each_aux_loss_by_its_share_of_the_targets():
    model = tiny_moe("mixtral")
    coef = model.router_aux_loss_coef
    sft = SFT(lora_cfg())
    micro = [batch(2, 1), batch(3, 8)]
    counts = [int((y[:, 1:] != IGNORE).sum()) for _, y in micro]
    total = float(sum(counts))
    step = sum(sft.loss(model, x, y, torch.tensor(total)) for x, y in micro)
    lm, aux = 0.0, 0.0
    for (x, y), c in zip(micro, counts, strict=True):
        out = model(input_ids=x, labels=y, output_router_logits=True)
        lm += float(out.loss - coef * out.aux_loss) * c / total  # the batch's mean, re-summed
        aux += float(out.aux_loss) * c / total
    assert float(step) == pytest.approx(lm + coef * aux, rel=1e-6)
    assert sft.metrics(identity)["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert sft.metrics(identity) == {}  # reset after a report


def test_aux_loss_trains_the_router():
    model = tiny_moe("qwen3_moe")
    x, y = batch(4, 0)
    SFT(lora_cfg()).loss(model, x, y, None).backward()
    with_aux = model.model.layers[0].mlp.gate.weight.grad.clone()
    model.zero_grad()
    model(input_ids=x, labels=y).loss.backward()
    without = model.model.layers[0].mlp.gate.weight.grad
    assert (with_aux - without).abs().max() > 1e-7


def test_a_dense_model_has_no_router_and_no_metric():
    from tests.support.small_model import tiny_llama

    model = tiny_llama(0)
    assert RouterAux.find(model) is None
    sft = SFT(lora_cfg())
    x, y = batch(5, 2)
    assert torch.equal(sft.loss(model, x, y, None), model(input_ids=x, labels=y).loss)
    assert sft.metrics(identity) == {}


def test_aux_loss_under_activation_checkpointing_gives_the_same_router_gradient():
    grads = []
    for checkpointing in (False, True):
        model = tiny_moe("qwen3_moe")
        if checkpointing:  # the routers run again in backward, after the hooks are gone
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        x, y = batch(7, 2)
        SFT(lora_cfg()).loss(model, x, y, None).backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    assert grads[0].abs().sum() > 0
