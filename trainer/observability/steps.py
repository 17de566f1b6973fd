"""The loop's step report: which steps are reported, the one all-reduce that makes every
rank agree on the loss and on when to report to Ray, and the record that goes to the
metrics file, the trackers and the log.

Throughput is training throughput: the window restarts after each report, so eval and
checkpoint time are not in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainer.distributed.hostsync import read_floats
from trainer.objectives.base import TABLES, UPDATE_TOKENS
from trainer.observability.metrics import MetricsFile, mfu

log = logging.getLogger("trainer")

REPORT_EVERY_S = 5.0
"""Seconds between metric-only ray.train.report calls; every step still goes to the
metrics file and the log, and every checkpoint is reported at once."""


class StepReport:
    def __init__(
        self,
        *,
        rt: Any,
        log_every: int,
        steps: int,
        steps_per_epoch: int,
        n_params: int,
        peak: float | None,
        all_reduce: Callable[[list[float]], list[float]],
        metrics_file: MetricsFile | None,
        tracker: Any,
        stats: Any,
    ):
        self.rt, self.log_every, self.steps = rt, log_every, steps
        self.steps_per_epoch, self.n_params, self.peak = steps_per_epoch, n_params, peak
        self.all_reduce, self.metrics_file, self.tracker, self.stats = (
            all_reduce,
            metrics_file,
            tracker,
            stats,
        )
        self.last: dict[str, Any] = {}
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self._last_ray_report = time.monotonic()
        self.ray_due = False

    def count(self, tokens: int) -> None:
        self.window_tokens += tokens

    def due(self, done: int, is_last: bool, saving: bool) -> bool:
        return done % self.log_every == 0 or is_last or saving

    def report(
        self,
        step: int,
        loss_acc: Any,
        lr: float,
        grad_norm: Any,
        started: float,
        tokens_seen: int,
        extra: Callable[[], dict[str, Any]],
    ) -> dict[str, Any]:
        """The step's record (collective). One all-reduce carries the loss, rank 0's "time
        to report to Ray" flag and each rank's count of checkpoint uploads still running, so
        all ranks agree on when to call ray.train.report (a barrier that waits for the
        controller's poll: per-step calls would cost ~2 s each in Ray 2.60). Ray hands
        reports to its controller in order, so a metrics report made while an async upload
        runs waits for that upload: during a storage outage it would stop training until
        storage came back. Metrics are reported once no rank has an upload running (the
        checkpoint's own report carries its metrics meanwhile). `extra` adds what else the
        step reports (per-source tokens, eval, per-worker stats: collectives included).
        The loss and the grad norm may still be on the device: both are read here, in one
        copy, the only host-device synchronisation a reported step makes for its record."""
        rt = self.rt
        loss_acc, grad_norm = read_floats(loss_acc, grad_norm)
        due = float(rt.rank == 0 and time.monotonic() - self._last_ray_report >= REPORT_EVERY_S)
        loss_sum, due, uploading = self.all_reduce([loss_acc, due, float(rt.uploads_in_flight())])
        self.ray_due = due > 0 and uploading == 0
        loss = loss_sum / rt.world_size
        now = time.perf_counter()
        window_s = max(now - self.window_start, 1e-9)
        tps = self.window_tokens / window_s
        self.window_start, self.window_tokens = now, 0
        done = step + 1
        metrics: dict[str, Any] = {
            "step": done,
            "time": time.time(),
            "epoch": step // self.steps_per_epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "step_time_s": now - started,
            "tokens_seen": tokens_seen,
            "mfu": mfu(self.n_params, tps / rt.world_size, self.peak),
        }
        metrics.update(extra())
        tables = metrics.pop(TABLES, None) or {}
        if UPDATE_TOKENS in metrics:  # the objective counts its own tokens (online RL)
            tps = metrics["tokens_per_s"] = metrics[UPDATE_TOKENS] / window_s
            metrics["mfu"] = mfu(self.n_params, tps / rt.world_size, self.peak)
        self.last = metrics
        if self.metrics_file is not None:
            self.metrics_file.write(
                {"event": "train", "attempt": self.metrics_file.attempt, **metrics}
            )
        self.tracker.metrics(metrics)
        for name, rows in tables.items():
            self.tracker.table(name, done, rows)
        if rt.rank == 0:
            log.info(
                "step %d/%d loss %.4f lr %.3g tokens/s %.0f mfu %s%s",
                done,
                self.steps,
                loss,
                lr,
                tps,
                "n/a" if metrics["mfu"] is None else f"{metrics['mfu']:.1%}",
                f" eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else "",
            )
        return metrics

    def first_attempt(self) -> bool:
        """Whether this is the run's first attempt, agreed by every rank (collective: rank 0
        holds the metrics file that knows)."""
        mf = self.metrics_file
        (first,) = self.all_reduce([float(mf is not None and mf.attempt == 1)])
        return first > 0

    def reported_to_ray(self) -> None:
        self._last_ray_report = time.monotonic()

    def restart_window(self) -> None:
        self.window_start = time.perf_counter()

    def flush(self) -> None:
        if self.rt.rank == 0 and self.metrics_file is not None:
            self.metrics_file.flush()

    def close(self) -> None:
        """The attempt's last flush (rank 0)."""
        if self.rt.rank == 0 and self.metrics_file is not None:
            self.metrics_file.close()
