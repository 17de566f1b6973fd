"""QLoRA's 4-bit base is not changed by evaluating it (trainer.model.adapters.keep_4bit_layout).

bitsandbytes 0.50.2's Linear4bit.forward, on CPUs with avx512_bf16 (this CI machine's
kind), rewrites its packed weight in place the first time it runs in eval mode on an input
that needs no grad: an evaluation mid-run changed the base, and so every later loss. The
strategy Raylift builds for a QLoRA job must leave every 4-bit weight byte for byte as it
was, and give the same training loss after an evaluation as before it. (The same guard end
to end, with a kill and an exact resume, is `make bench`'s
test_strategies.py::test_qlora_eval_mid_training_changes_nothing_and_resume_is_exact.)"""

from __future__ import annotations

import torch

from tests.support.small_model import VOCAB, small_strategy, tiny_llama


def _packed(model: torch.nn.Module) -> dict[str, bytes]:
    import bitsandbytes as bnb

    return {
        name: m.weight.data.detach().clone().contiguous().view(torch.uint8).numpy().tobytes()
        for name, m in model.named_modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_evaluating_a_qlora_base_leaves_its_4bit_weights_and_losses_unchanged(tmp_path):
    tiny_llama(0, tie_word_embeddings=False).save_pretrained(tmp_path, safe_serialization=True)
    model = small_strategy(tmp_path, adapter="qlora").model
    before = _packed(model)
    assert before, "no 4-bit layer in the QLoRA model"
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    trained = _loss(model, ids)
    model.eval()  # what an evaluation does: eval mode, inputs that need no grad
    _loss(model, ids)
    model.train()
    after = _packed(model)
    changed = sorted(name for name in before if after[name] != before[name])
    assert changed == [], f"evaluation rewrote {len(changed)} 4-bit weights: {changed[:3]}"
    assert _loss(model, ids) == trained
