"""One case of the linear cross-entropy bench, in a process of its own so that its peak
resident memory is its own: `python -m tests.bench.linear_ce_worker MODE VOCAB HIDDEN
TOKENS CHUNK` prints one JSON line: the peak RSS above the inputs' (bytes) and the
seconds of one loss + backward.

plain is what a Hugging Face causal LM does (lm_head over every token, the fp32 upcast,
the cross-entropy over the shifted labels: the loss function trainer.objectives'
unit tests hold it equal to), keeping only the loss as ModelCalls.train_micro does;
chunked is trainer.objectives.linear_ce."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from trainer.objectives import linear_ce


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _loss(mode: str, h, w, labels, chunk: int) -> torch.Tensor:
    if mode == "chunked":
        return linear_ce.chunked_linear_cross_entropy(h, w, None, labels, None, None, chunk)
    logits = F.linear(h, w).float()
    targets = linear_ce.shifted_targets(labels)
    return F.cross_entropy(logits.view(-1, w.shape[0]), targets, ignore_index=-100)


def main(mode: str, vocab: int, hidden: int, tokens: int, chunk: int) -> dict[str, float]:
    torch.manual_seed(0)
    # Warm the kernels and thread pools at a tiny size first: their one-off allocations
    # are not the loss's.
    small = torch.randn(8, 16, requires_grad=True)
    _loss(
        mode, small, torch.randn(32, 16, requires_grad=True), torch.randint(0, 32, (1, 8)), 4
    ).backward()
    h = (torch.randn(1, tokens, hidden) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden) * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    labels[:, : tokens // 4] = -100  # a prompt
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    _loss(mode, h, w, labels, chunk).backward()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    assert h.grad is not None and w.grad is not None
    return {"peak_bytes": float(max(0, peak - base) * 1024), "seconds": seconds}


if __name__ == "__main__":
    mode, *sizes = sys.argv[1:]
    print(json.dumps(main(mode, *map(int, sizes))))
