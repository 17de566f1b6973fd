"""TRL is the oracle under every strategy: the one-process oracle's batch (prompts,
completions, advantages, old log-probs of a policy one update away, a reference's
log-probs) split over 2 ranks (torchrun, gloo, CPU, no Ray) and through each strategy's
train_micro with accumulation 2, gives TRL's GRPOTrainer loss and every trainable
parameter's gradient on one process within 1e-5: DDP, FSDP2 and ZeRO-3 (DS_ACCELERATOR
cpu), full and LoRA, with num_iterations 2, beta 0.04, temperature 0.7, for dapo (its
divisor counts the tokens of every rank) and grpo (its per-completion means).

The strategies compute in float32 and TRL here in float64 from the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.rl_batch import VOCAB, grpo_stand_in, rl_batch
from tests.support.small_model import tiny_llama
from tests.support.torchrun import torchrun
from tests.unit.rl.test_grpo_trl import ADVANTAGES, _close, _old_and_ref

CASES = [
    "ddp:none:dapo",
    "ddp:none:grpo",
    "fsdp:none:dapo",
    "fsdp:lora:grpo",
    "ddp:lora:dapo",
    "zero3:none:dapo",
    "zero3:lora:dapo",
]
"""strategy:adapter:loss_type; ZeRO-3 last (tests.support.rl_oracle_worker says why)."""


def _oracle(adapter: str, loss_type: str, old, ref) -> tuple[float, dict[str, torch.Tensor]]:
    """TRL's GRPOTrainer._compute_loss on the whole batch, one process, float64."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from tests.support.rl_oracle_worker import case_config
    from trainer.model import adapters

    model = tiny_llama(0, VOCAB).double()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    if adapter != "none":
        cfg = case_config("unused", Path("unused/out"), "ddp", adapter, loss_type)
        model = adapters.apply(model, cfg, grew_vocab=False).double()
    trainer = grpo_stand_in(
        model, loss_type, 0.04, accum=1, max_len=7, epsilon=0.2, epsilon_high=0.28
    )
    b = rl_batch()
    inputs = {
        "prompt_ids": b.prompt_ids,
        "prompt_mask": b.prompt_mask,
        "completion_ids": b.completion_ids,
        "completion_mask": b.completion_mask,
        "advantages": ADVANTAGES,
        "num_items_in_batch": b.completion_mask.sum(),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    loss = GRPOTrainer._compute_loss(trainer, model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss), grads


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, torch.Tensor, torch.Tensor]:
    root = tmp_path_factory.mktemp("grpo_sharded")
    tiny_llama(0, VOCAB).save_pretrained(root / "model")
    old, ref = _old_and_ref(0.7)
    # What the feed holds is float32: the oracle gets the same rounded values.
    old, ref = old.float().double(), ref.float().double()
    torch.save({"advantages": ADVANTAGES, "old": old, "ref": ref}, root / "inputs.pt")
    out = root / "results.pt"
    args = ["-m", "tests.support.rl_oracle_worker", str(root / "model"), str(root / "inputs.pt")]
    proc = torchrun([*args, str(out), *CASES], nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out), old, ref


@pytest.mark.parametrize("case", CASES)
def test_loss_and_every_gradient_match_trl(case: str, results) -> None:
    got, old, ref = results
    _, adapter, loss_type = case.split(":")
    loss, grads = _oracle(adapter, loss_type, old, ref)
    ours = got[case]
    assert abs(loss) > 1e-3  # off-policy and KL: a loss that is not 0
    assert ours["loss"] == pytest.approx(loss, rel=1e-5)
    assert ours["grads"].keys() == grads.keys() and grads
    for name, g in grads.items():
        _close(ours["grads"][name], g)
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-4
