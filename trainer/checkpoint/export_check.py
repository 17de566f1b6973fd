"""Proof that an export serves the model that was trained, checked before it is uploaded.

A merged export (`model.lora.merge_on_export`) is a new set of weights: a wrong merge (a
scaled, transposed or dropped delta, the peers' open FSDP2 and QLoRA merge bugs) still
loads and generates, just not the fine-tuned model. So after the folder is written it is
loaded back and its logits on a fixed batch are compared with the un-merged reference:
the same base the merge started from with the adapter folder applied by PEFT. A mismatch
fails the export with one line; a folder that does not match is never uploaded.

The merge (trainer.model.adapters.export) starts from the full-precision base weights in
the model folder, LoRA and QLoRA alike: for QLoRA that is the base before its 4-bit
quantization, not the NF4 base the adapter trained against (which differs from it by the
quantization error); the check's reference uses the same base, and its log line says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import JobConfig
from trainer.errors import NotRetried

log = logging.getLogger("trainer")

TOLERANCE: dict[str, float] = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
"""Largest allowed |merged - reference| over the batch's logits, relative to the largest
|reference| logit, by the merged weights' dtype. fp32: merged and un-merged differ only
in rounding order ((W + s·BA)x against Wx + s·B(Ax)), ~1e-7 per layer."""

BATCH_ROWS, BATCH_LEN, BATCH_SEED = 2, 16, 1234


class ExportCheckError(NotRetried):
    """An export was written but does not give the trained model's outputs. Not retried:
    the same checkpoint would write and fail the same export again."""


@dataclass(frozen=True)
class LogitsCheck:
    """One export's check: what was compared, the measured error and the bound."""

    export: str
    reference: str
    rel_error: float
    tolerance: float
    max_diff: float | None = None
    """The largest |export - reference| logit difference itself (rel_error is it over the
    largest |reference| logit); None in checks.json files written before it was kept."""

    @property
    def passed(self) -> bool:
        return self.rel_error <= self.tolerance

    def line(self) -> str:
        verdict = "match" if self.passed else "DO NOT match"
        diff = "" if self.max_diff is None else f"max difference {self.max_diff:.3g}, "
        return (
            f"{self.export}: logits {verdict} {self.reference} on a fixed "
            f"{BATCH_ROWS}x{BATCH_LEN} batch ({diff}max error {self.rel_error:.2e} of the "
            f"largest logit, tolerance {self.tolerance:.0e})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "export": self.export,
            "reference": self.reference,
            "rel_error": self.rel_error,
            "tolerance": self.tolerance,
            "max_diff": self.max_diff,
            "passed": self.passed,
        }


def fixed_batch(vocab_size: int) -> Any:
    """The same token ids on every run and rank, from a generator of their own (never the
    global RNG, which training owns)."""
    import torch

    gen = torch.Generator().manual_seed(BATCH_SEED)
    return torch.randint(0, vocab_size, (BATCH_ROWS, BATCH_LEN), generator=gen)


def logits_of(model: Any, ids: Any) -> Any:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def compare(export: str, reference: str, got: Any, want: Any, tol: float) -> LogitsCheck:
    """The relative error of `got` against `want` (both logits of the fixed batch)."""
    if got.shape != want.shape:
        raise ExportCheckError(
            f"{export}: logits of shape {tuple(got.shape)} where {reference} gives "
            f"{tuple(want.shape)}; the folder is not the trained model, do not serve it"
        )
    scale = max(float(want.abs().max()), 1e-12)
    diff = float((got - want).abs().max())
    return LogitsCheck(export, reference, diff / scale, tol, diff)


def require(check: LogitsCheck) -> LogitsCheck:
    """Log the check's line; a failed check is one error line that names the folder."""
    if not check.passed:
        raise ExportCheckError(
            "export check failed: "
            + check.line()
            + "; the export is not uploaded: report this as a Raylift bug "
            "(the run's checkpoints keep the trained weights)"
        )
    log.info("%s", check.line())
    return check


def check_merged(export_dir: Path, base_dir: Path, cfg: JobConfig, vocab_size: int) -> LogitsCheck:
    """`export_dir/model_merged` against `base_dir` + `export_dir/adapter` (un-merged).
    The reference is computed and freed before the merged folder is loaded, so at most one
    extra copy of the model is in memory at a time."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.model.adapters import ADAPTER_DIR, MERGED_DIR
    from trainer.model.loading import load_model

    merged_dir, adapter_dir = export_dir / MERGED_DIR, export_dir / ADAPTER_DIR
    ids = fixed_batch(vocab_size)
    base = load_model(base_dir, cfg, vocab_size, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(adapter_dir))
    want = logits_of(reference, ids)
    del reference, base
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    dtype = next(merged.parameters()).dtype
    got = logits_of(merged, ids)
    del merged
    what = "base + adapter"
    if cfg.model.adapter == "qlora":
        what = "the full-precision base (not the NF4 base it trained on) + adapter"
    return compare(
        MERGED_DIR, what, got, want, TOLERANCE.get(str(dtype).removeprefix("torch."), 1e-5)
    )


def check_gguf(path: Path, hf_dir: Path, gguf_type: str) -> LogitsCheck:
    """A GGUF file against the HF folder it was made from: transformers loads it back
    (dequantized, the Q/K layout undone) and both run the fixed batch."""
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint.gguf_export import GGUF_DIR, TOLERANCE

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    ids = fixed_batch(hf.config.vocab_size)
    want = logits_of(hf, ids)
    del hf
    back = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    got = logits_of(back, ids)
    del back
    name = f"{GGUF_DIR}/{path.name}"
    return compare(name, f"{hf_dir.name}/ (read back dequantized)", got, want, TOLERANCE[gguf_type])


CHECKS_FILE = "checks.json"
"""Written into each export folder: every check made on it (what `status` and the report
show), so the folder carries its own proof."""


def finish_export(export_dir: Path, base_dir: Path, cfg: JobConfig, tokenizer: Any) -> list:
    """What follows the strategy's write, on the rank that wrote: the merged folder's check,
    then the extra formats (export.formats) with theirs, and checks.json. Any failed check
    raises before anything is uploaded."""
    import json

    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    from trainer.checkpoint.gguf_export import GGUF_DIR, write_gguf
    from trainer.model.adapters import MERGED_DIR

    if is_deepspeed_zero3_enabled():
        # A ZeRO-3 process's HF config would partition the check's loads on rank 0 alone
        # (the strategy's adapter export drops it for its merge the same way).
        unset_hf_deepspeed_config()
    checks: list[LogitsCheck] = []
    vocab = len(tokenizer) if tokenizer is not None else None
    if (export_dir / MERGED_DIR).is_dir() and vocab is not None:
        checks.append(require(check_merged(export_dir, base_dir, cfg, vocab)))
    if "gguf" in cfg.export.formats:
        full = export_dir / (MERGED_DIR if (export_dir / MERGED_DIR).is_dir() else "model")
        for gguf_type in cfg.export.gguf_types:
            path = write_gguf(full, export_dir / GGUF_DIR, gguf_type, cfg.run.name)
            checks.append(require(check_gguf(path, full, gguf_type)))
    contents = sorted(
        p.relative_to(export_dir).as_posix()
        for p in [*export_dir.iterdir(), *export_dir.glob("gguf/*.gguf")]
        if p.name != GGUF_DIR
    )
    record = {"contents": contents, "checks": [c.as_dict() for c in checks]}
    (export_dir / CHECKS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return checks


def export_lines(run: Any) -> list[str]:
    """The run's newest export, what it holds and each check made on it (its checks.json),
    as `label: text` lines for `raylift report` and `raylift status`. Reads storage only; no
    torch, so the laptop's tools can call it."""
    import json

    from trainer.checkpoint.manager import latest_export

    loc = latest_export(run)
    if loc is None:
        return []
    try:
        with loc.fs.open_input_stream(loc.join(CHECKS_FILE).path) as f:
            record = json.loads(f.read().decode())
    except (FileNotFoundError, OSError, ValueError):
        return [f"export: {loc.uri} (no {CHECKS_FILE}: written unchecked, before checks existed)"]
    lines = [f"export: {loc.uri} ({', '.join(record.get('contents', [])) or 'empty'})"]
    for c in record.get("checks", []):
        lines.append(
            "checked: "
            + LogitsCheck(
                c["export"],
                c["reference"],
                float(c["rel_error"]),
                float(c["tolerance"]),
                None if c.get("max_diff") is None else float(c["max_diff"]),
            ).line()
        )
    if not record.get("checks"):
        lines.append("checked: nothing due (no merged folder and no extra formats)")
    return lines
