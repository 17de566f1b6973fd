"""gpu-check's loss bench (issue 47): the causal-LM head and loss on one GPU, each kernel side
by side on the same inputs, so that `train.loss: auto`'s choice is measured.

Kernels: `plain` (Hugging Face's: lm_head's whole logits, upcast to fp32, cross-entropy),
`chunked` (Raylift's torch version, trainer.objectives.linear_ce) and `liger` (liger-kernel's
fused linear cross-entropy, when it imports). Shapes: a Llama-3-8B head (hidden 4096) at
vocab 128,256 and 32,000, 8 × 512 tokens, bf16 weights and hidden states, a quarter of the
targets ignored (a prompt). Per kernel and shape: the peak memory its forward + backward
allocates above the inputs (torch.cuda.max_memory_allocated), tokens/s over timed
iterations after a warm-up (Triton compiles there), and its loss and both gradients
against an fp32 plain reference (relative error: max |diff| / max |reference|, the bf16
tolerance is stated, not assumed). Writes <out>/loss.json and prints a table.

`--cpu` (and any machine without CUDA) runs the same at a toy size in fp32, plain and
chunked only: a unit test runs it so it cannot rot; its memory is not measured.

    python -m tools.gpucheck.loss [--out build/gpucheck] [--iters 5] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

GPU_SHAPES = [(4096, 128256, 8 * 512), (4096, 32000, 8 * 512)]
"""(hidden, vocab, tokens): a Llama-3-8B head, then a Llama-2-sized vocabulary."""
CPU_SHAPES = [(32, 500, 96)]
MISSING = "liger_kernel does not import"
BF16_TOLERANCE = 2e-2
"""What a bf16 kernel's loss and gradients may differ from the fp32 reference by (about
eight bf16 ulps at the gradients' largest entries); printed beside each figure."""


def inputs(hidden: int, vocab: int, tokens: int, device: Any, dtype: Any, seed: int = 0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(1, tokens, hidden, generator=g) * 1.0).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    labels[0, : tokens // 4] = -100
    return h, w, labels.to(device)


def kernels() -> dict[str, Callable[..., Any] | None]:
    """Each kernel as loss(h, w, labels); None where it does not import."""
    import torch

    from trainer.objectives import linear_ce

    def plain(h: Any, w: Any, labels: Any) -> Any:
        logits = torch.nn.functional.linear(h, w).float()
        targets = linear_ce.shifted_targets(labels)
        flat = logits.reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, targets, ignore_index=-100)

    def chunked(h: Any, w: Any, labels: Any) -> Any:
        return linear_ce.chunked_linear_cross_entropy(h, w, None, labels)

    def liger(h: Any, w: Any, labels: Any) -> Any:
        return linear_ce.liger_linear_cross_entropy(h, w, None, labels)

    return {
        "plain": plain,
        "chunked": chunked,
        "liger": liger if linear_ce.liger_importable() else None,
    }


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def run_one(fn: Callable[..., Any], h0: Any, w0: Any, labels: Any, iters: int) -> dict:
    """One kernel: its loss and gradients (the first call), then the timing; on CUDA the
    peak memory of one forward + backward above what was allocated before it."""
    import torch

    cuda = h0.is_cuda
    h, w = h0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()

    def step() -> Any:
        h.grad = w.grad = None
        loss = fn(h, w, labels)
        loss.backward()
        return loss

    step()  # warm-up: Triton's compile, cuBLAS's workspace
    h.grad = w.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    loss = step()
    out: dict[str, Any] = {"loss": loss.detach(), "grad_h": h.grad, "grad_w": w.grad}
    if cuda:
        torch.cuda.synchronize()
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if cuda:
        torch.cuda.synchronize()
    out["seconds"] = (time.perf_counter() - start) / max(iters, 1)
    return out


def bench(gpu: bool, iters: int) -> list[dict[str, Any]]:
    import torch

    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = []
    for hidden, vocab, tokens in GPU_SHAPES if gpu else CPU_SHAPES:
        h, w, labels = inputs(hidden, vocab, tokens, device, dtype)
        fns = kernels()
        ref = run_one(fns["plain"], h.float(), w.float(), labels, 0)  # the fp32 reference
        ref_parts = {k: ref[k] for k in ("loss", "grad_h", "grad_w")}
        del ref
        for name, fn in fns.items():
            row: dict[str, Any] = {"kernel": name, "hidden": hidden, "vocab": vocab}
            row.update(tokens=tokens, dtype=str(dtype).replace("torch.", ""))
            if fn is None:
                rows.append({**row, "error": MISSING})
                continue
            if not gpu and name == "liger":
                continue
            try:
                got = run_one(fn, h, w, labels, iters)
            except Exception as exc:  # a kernel that fails is a finding, not a crash
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            row["tokens_per_s"] = tokens / got["seconds"] if got["seconds"] else None
            row["peak_mib"] = got.get("peak_mib")
            for part, value in ref_parts.items():
                row[f"{part}_rel_err"] = _rel(got[part], value)
            rows.append(row)
            del got
        if gpu:
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]], tolerance: float) -> str:
    head = "kernel   vocab    peak MiB  tokens/s    loss err  grad_h err  grad_w err"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kernel']:<8} {r['vocab']:<8} {r['error']}")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        errs = [r[f"{p}_rel_err"] for p in ("loss", "grad_h", "grad_w")]
        lines.append(
            f"{r['kernel']:<8} {r['vocab']:<8} {peak:>8}  {r['tokens_per_s']:>9,.0f}  "
            + "  ".join(f"{e:>9.1e}" + ("" if e <= tolerance else "!") for e in errs)
        )
    lines.append(f"errors against an fp32 reference; tolerance {tolerance:g} ('!' beyond it)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "gpucheck")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per kernel")
    p.add_argument("--cpu", action="store_true", help="the toy CPU run even with CUDA")
    args = p.parse_args(argv)

    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    tolerance = BF16_TOLERANCE if gpu else 1e-5
    rows = bench(gpu, args.iters)
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    report = {"gpu": gpu, "device": device, "tolerance": tolerance, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss.json").write_text(json.dumps(report, indent=2))
    print(f"gpucheck loss kernels on {device}:")
    print(table(rows, tolerance))
    return 0 if all(within(r, tolerance) for r in rows) else 1


def within(row: dict[str, Any], tolerance: float) -> bool:
    """A row passes when its errors are within the tolerance; a kernel that failed fails,
    one that is not installed is reported, not failed."""
    if "error" in row:
        return row["error"] == MISSING
    return all(row[f"{p}_rel_err"] <= tolerance for p in ("loss", "grad_h", "grad_w"))


if __name__ == "__main__":
    sys.exit(main())
