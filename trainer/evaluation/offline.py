"""`python -m trainer eval RUN --tasks ...`: a run's checkpoints scored after the run, as
the Ray job `raylift eval` submits (or in any process that reaches the run's storage).

Each checkpoint (`RUN/step_<N>/`, every complete one or the chosen steps) is loaded the
way a resume loads it, by the run's own strategy in a world of one process (its config is
the run's job.json), and written out by the strategy's `export`, the same function that
writes the run's export/ folders. lm-eval's HF model scores that folder, so the numbers
are the ones `lm_eval.simple_evaluate` gives on the export a team would ship. The table
(eval.json, eval.md) and the plot (eval.png) go to RUN/eval/.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config import JobConfig
from trainer.errors import UserError

log = logging.getLogger("trainer.eval")
EVAL_DIR = "eval"
JOB_RECORD = "job.json"
"""trainer.runtime.launch.JOB_RECORD: runtime sits above evaluation, which reads it here."""


def run_config(run: Any) -> JobConfig:
    """The validated job the run trained with (RUN/job.json, written by the launch)."""
    try:
        with run.fs.open_input_stream(run.join(JOB_RECORD).path) as f:
            record = json.loads(f.read().decode())
    except (OSError, FileNotFoundError):
        raise UserError(
            f"{run.uri}: no {JOB_RECORD}: not a Raylift run folder (give storage.path/run.name)"
        ) from None
    return JobConfig.model_validate(record["config"])


Listing = Callable[[Any], list[tuple[int, Any]]]
"""(step, location) of a run's complete checkpoints, in step order: the checkpoint
package's listing, handed in by the caller (trainer.__main__) since checkpoint sits above
evaluation in the import order."""


def checkpoints(run: Any, steps: list[int] | None, listing: Listing) -> list[tuple[int, Any]]:
    """(step, location) of each complete checkpoint, in step order; only `steps` if given."""
    found = listing(run)
    if steps:
        found = [(s, loc) for s, loc in found if s in set(steps)]
    if not found:
        chosen = f" at steps {steps}" if steps else ""
        raise UserError(
            f"{run.uri}: no complete checkpoint{chosen} to score (checkpoint.keep_last keeps "
            "the newest only); `raylift eval` on an export folder scores that instead"
        )
    return found


def _one_process_group(tmp: Path) -> bool:
    """A gloo world of one, which every strategy's setup expects; False if one exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ[key] = value
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    return True


def export_checkpoint(cfg: JobConfig, ckpt: Path, out: Path) -> Path:
    """The HF folder of the checkpoint at `ckpt` (a local copy), written under `out` by the
    run's strategy exactly as the run's export is: the merged model for an adapter run that
    merges, else the model."""
    import gc

    import torch

    from trainer.model.folders import local_model_dir, local_tokenizer_dir
    from trainer.model.loading import load_tokenizer
    from trainer.strategies.base import ModelSource, build_strategy

    tokenizer = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    strategy = build_strategy(cfg, torch.device("cpu"), 0, 1)
    strategy.setup(ModelSource(local_model_dir(cfg), len(tokenizer)))
    strategy.load_state(ckpt / "strategy", 0)
    strategy.export(out, 0, tokenizer)
    del strategy
    gc.collect()
    for name in ("model_merged", "model"):
        if (out / name / "config.json").is_file():
            return out / name
    raise UserError(
        f"{ckpt}: the export holds an adapter only; set export.merge_on_export: true in the "
        "job to score its checkpoints"
    )


def score_run(
    uri: str,
    specs: list[str],
    listing: Listing,
    steps: list[int] | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    endpoint: str | None = None,
    region: str | None = None,
) -> list[dict[str, Any]]:
    """Rows (step, checkpoint, scores) of every chosen checkpoint of the run at `uri`,
    written to RUN/eval/ as a table and a plot; the rows are returned."""
    from lm_eval.models.huggingface import HFLM

    from trainer.evaluation import table
    from trainer.evaluation.specs import check
    from trainer.evaluation.tasks import evaluate, scores
    from trainer.storage.location import download_dir, resolve
    from trainer.storage.transfer import upload_dir

    check(specs, strict=True)
    run = resolve(uri, endpoint, region)
    cfg = run_config(run)
    found = checkpoints(run, steps, listing)
    rows = []
    with tempfile.TemporaryDirectory(prefix="raylift-eval-") as tmp_name:
        tmp = Path(tmp_name)
        owned = _one_process_group(tmp)
        try:
            for step, loc in found:
                local = Path(loc.path) if not run.is_s3 else download_dir(loc, tmp / f"c{step}")
                log.info("scoring %s (step %d) on %s", loc.uri, step, ", ".join(specs))
                folder = export_checkpoint(cfg, local, tmp / f"export-{step}")
                lm = HFLM(pretrained=str(folder), device="cpu", batch_size=batch_size)
                results = evaluate(lm, specs, limit)
                rows.append({"step": step, "model": loc.uri, **scores(results or {})})
                del lm
                shutil.rmtree(tmp / f"export-{step}", ignore_errors=True)
        finally:
            if owned:
                import torch.distributed as dist

                dist.destroy_process_group()
        written = table.write(rows, tmp / EVAL_DIR)
        target = run.join(EVAL_DIR)
        upload_dir(tmp / EVAL_DIR, target)
    print(table.markdown(rows), end="", flush=True)
    for kind, path in written.items():
        print(f"{kind}: {target.join(path.name).uri}", flush=True)
    return rows
