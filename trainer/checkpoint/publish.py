"""Publishing a reported step: what leaves the workers, each when due. The user's export
(a plain Hugging Face or adapter folder under export/step_<N>/), the resume checkpoint
(the checkpoint manager's save), and the report to Ray, which owns the checkpoint folder
once it is reported. The loop decides *whether* each is due; this module owns *how*, and
the order: export, then the checkpoint, then the report that hands the checkpoint over.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import manager as ckpt_mod
from trainer.checkpoint.manager import CheckpointManager
from trainer.config import JobConfig
from trainer.storage.transfer import upload_dir

if TYPE_CHECKING:
    from trainer.distributed.seam import Runtime
    from trainer.observability.steps import StepReport
    from trainer.strategies.base import Strategy

log = logging.getLogger("trainer")


class Publish:
    """What a reported step hands out, each when due: the user's export, the checkpoint,
    and the report to Ray (which owns the checkpoint folder once reported)."""

    def __init__(
        self,
        cfg: JobConfig,
        rt: Runtime,
        strategy: Strategy,
        tokenizer: Any,
        manager: CheckpointManager,
        report: StepReport,
    ):
        self.cfg, self.rt, self.strategy, self.tokenizer = cfg, rt, strategy, tokenizer
        self.manager, self.report = manager, report

    def after_step(
        self,
        step: int,
        metrics: dict[str, Any],
        export: bool,
        save: bool,
        emergency: bool,
        is_last: bool,
    ) -> float:
        """Returns when the checkpoint's save started (the emergency checkpoint's account)."""
        rt, report, done = self.rt, self.report, step + 1
        if export:
            export_model(rt, self.strategy, self.tokenizer, done, self.cfg)
            report.tracker.tag(
                "raylift.export", rt.run.join(ckpt_mod.EXPORT_DIR, ckpt_mod.dir_name(done)).uri
            )
        ckpt_dir = None
        saving = time.monotonic()
        if save:
            ckpt_dir = self.manager.save(
                {
                    "epoch": step // report.steps_per_epoch,
                    "seed": self.cfg.train.seed,
                    "rank0_node_labels": rt.node_labels,
                    "metrics": {k: v for k, v in metrics.items() if v is not None},
                }
            )
            rt.note_save(done, time.monotonic() - saving)
            report.flush()
            report.tracker.flush()
        kind = "emergency" if emergency else ("final" if is_last else "periodic")
        owned = False
        try:
            if ckpt_dir is not None or report.ray_due or is_last:
                owned = rt.report(metrics, done, ckpt_dir, kind)
                report.reported_to_ray()
        finally:
            if ckpt_dir is not None and not owned:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
        return saving


def export_model(
    rt: Runtime, strategy: Strategy, tokenizer: Any, step: int, cfg: JobConfig
) -> None:
    """The user's export, separate from resume state: written locally by the rank(s) that
    hold it, checked on rank 0 (trainer.checkpoint.export_check: the merged folder against
    base + adapter, the extra formats against the HF folder), then uploaded to
    export/step_<N>/. A failed check uploads nothing. Collective."""
    tmp = Path(tempfile.mkdtemp(prefix=f"raylift-export-{step}-r{rt.rank}-"))
    try:
        if strategy.export(tmp, rt.rank, tokenizer):
            if rt.rank == 0:
                from trainer.checkpoint.export_check import finish_export
                from trainer.model.folders import local_model_dir

                finish_export(tmp, local_model_dir(cfg), cfg, tokenizer)
            target = rt.run.join(ckpt_mod.EXPORT_DIR, ckpt_mod.dir_name(step))
            upload_dir(tmp, target)
            if rt.rank == 0:
                log.info("exported step %d to %s", step, target.uri)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rt.barrier()
