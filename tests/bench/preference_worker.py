"""One case of the preference-reference bench, in a process of its own so that its peak
resident memory is its own: `python -m tests.bench.preference_worker MODE HIDDEN LAYERS
VOCAB PAIRS BLOCK STEPS` prints one JSON line: the peak RSS (bytes, whole process, the
imports' baseline taken off) and the seconds per DPO step.

precomputed is what Raylift runs in full fine-tuning: one model, the reference a column
of log-probs (trainer.objectives.reference); live is the usual alternative: a second,
frozen copy of the model whose no-grad forward gives the reference on every step. Both
run the same objective (trainer.objectives.preference) and AdamW."""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import load_config
from trainer.objectives import build_objective
from trainer.objectives.losses import sequence_logps


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(mode: str, hidden: int, layers: int, vocab: int, pairs: int, block: int, steps: int):
    torch.manual_seed(0)
    base = _kib("VmRSS")
    cfg = load_config(
        {
            "model": {"path": "unused"},
            "data": {"train_file": "unused.jsonl", "block_size": block},
            "train": {"objective": "dpo", "max_steps": steps, "micro_batch_size": pairs},
            "scaling": {"num_workers": 1},
            "run": {"name": "bench"},
        }
    )
    objective = build_objective(cfg)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        max_position_embeddings=block,
    )
    model = LlamaForCausalLM(config).float().train()
    reference = None
    if mode == "live":
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(1, vocab, (2 * pairs, block))
    labels = ids.clone()
    labels[:, : block // 4] = -100  # the prompt
    column = -float(block) * torch.rand(2 * pairs, dtype=torch.float64)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        ref = column
        if reference is not None:
            with torch.no_grad():
                ref = sequence_logps(reference(input_ids=ids).logits, labels)[0]
        loss = objective.loss(model, ids, labels, torch.tensor(float(pairs)), ref=ref)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    return {
        "peak_bytes": float(max(0, _kib("VmHWM") - base) * 1024),
        "seconds_per_step": min(seconds),
        "weight_bytes": float(params * 4),
    }


if __name__ == "__main__":
    mode, *sizes = sys.argv[1:]
    print(json.dumps(main(mode, *map(int, sizes))))
