"""The reference log-probs of full fine-tuning, computed once before step 1.

DPO, IPO and hinge compare the policy with a frozen reference: the model as it was
loaded. Instead of a second copy of the model on every GPU, the workers run one pass over
every pair with the model they are about to train (the same strategy: its shards, its
precision), before any optimizer step, and store each sequence's summed completion
log-prob beside the token cache, in `reference-<key>/logps.npy`, keyed by the reference
model (its path, config and weight files), the precision and the attention kernel; the
data are the cache's own key. Training reads it back as a column of the batch.

A resubmission or a resume finds the file and skips the pass. The pass runs before the
loop restores a checkpoint, on the model as loaded, so a lost file costs a pass again,
never a wrong reference. A pass cut short (a
SIGKILL, a lost node) leaves no file, only its parts, and the next attempt, which restores
no checkpoint because none was written before step 1, runs the pass again from the start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig
from trainer.data.blocks import eval_indices
from trainer.errors import UserError
from trainer.objectives.pairs import PairBlocks

log = logging.getLogger(__name__)

KILL_IN_REFERENCE_ENV = "RAYLIFT_FAULT_KILL_IN_REFERENCE"
"""A fault drill: =N makes the last rank SIGKILL itself after its Nth batch of the
reference pass, once per run (see trainer.faults for the others)."""


def reference_key(cfg: JobConfig, model_dir: Path) -> str:
    """The reference model's identity: what changes its log-probs."""
    h = hashlib.sha256(
        f"{cfg.model.path}|{cfg.train.precision}|{cfg.model.attn_implementation}|"
        f"{cfg.model.special_tokens}".encode()
    )
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
        if f.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def reference_dir(pairs: PairBlocks, key: str) -> Path:
    return pairs.cache.dir / f"reference-{key}"


def ensure_reference(cfg: JobConfig, strategy: Any, pairs: PairBlocks, rt: Any) -> None:
    """Fill `pairs.reference`: read the stored log-probs, or compute them first, on every
    rank together (collective)."""
    from trainer.model.loading import local_model_dir

    folder = reference_dir(pairs, reference_key(cfg, local_model_dir(cfg)))
    final = folder / "logps.npy"
    rt.barrier()  # every rank looks before any writes: they agree whether to compute
    if not final.exists():
        compute_reference(cfg, strategy, pairs, rt, folder)
    values = np.load(final)
    if values.shape != pairs.reference.shape or np.isnan(values).any():
        raise UserError(f"{final}: not this cache's reference log-probs; delete {folder}")
    pairs.reference = values
    if rt.rank == 0:
        log.info("reference log-probs of %d pairs from %s", len(pairs), final)


def compute_reference(
    cfg: JobConfig, strategy: Any, pairs: PairBlocks, rt: Any, folder: Path
) -> None:
    """One pass over every pair, each data-parallel replica a stride of them (padded to
    the same number of batches: a sharded forward is a collective); rank 0 joins the
    replicas' parts into the file, which appears whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    replica, replicas = cfg.data_rank(rt.rank, rt.world_size)
    batches = eval_indices(len(pairs), cfg.train.micro_batch_size, replicas, replica, None)
    device = next(p.device for p in strategy.model.parameters())
    rows_done, values = [], []
    started = time.monotonic()
    kill_at = _kill_batch(rt)
    with strategy.evaluating():
        for b, ix in enumerate(batches):
            ids, labels, _ = pairs.gather(np.maximum(ix, 0))
            x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
            # the objective's: under strategy.sp each worker forwards its share of a row
            logps = strategy.objective.row_logps(strategy, x, y).double().cpu().numpy()
            keep = np.concatenate([ix, ix]) >= 0
            rows_done.append(pairs.rows(ix)[keep])
            values.append(logps[keep])
            if rt.rank == 0 and (b + 1) % 50 == 0:
                log.info("reference pass: %d/%d batches", b + 1, len(batches))
            if b + 1 == kill_at:
                _kill(rt, kill_at)
    if rt.rank % cfg.model_parallel == 0:
        part = folder / f"part-{replica:05d}.npz"
        np.savez(
            str(part) + ".tmp.npz", rows=np.concatenate(rows_done), values=np.concatenate(values)
        )
        os.replace(str(part) + ".tmp.npz", part)
    rt.barrier()
    if rt.rank == 0:
        out = np.full(pairs.reference.shape, np.nan)
        for r in range(replicas):
            with np.load(folder / f"part-{r:05d}.npz") as part:
                out[part["rows"]] = part["values"]
        tmp = folder / f"logps.{os.getpid()}.tmp.npy"
        np.save(tmp, out)
        os.replace(tmp, folder / "logps.npy")
        for r in range(replicas):
            (folder / f"part-{r:05d}.npz").unlink(missing_ok=True)
        log.info(
            "reference pass: %d pairs in %.1f s on %d replicas",
            len(pairs),
            time.monotonic() - started,
            replicas,
        )
    rt.barrier()


def _kill_batch(rt: Any) -> int:
    """The drill's batch, on the last rank only, and once per run (a marker file beside
    the machine's temp files, as trainer.faults' drills do); 0 otherwise."""
    at = int(os.environ.get(KILL_IN_REFERENCE_ENV, "0") or 0)
    if not at or rt.rank != rt.world_size - 1 or _marker(rt, at).exists():
        return 0
    return at


def _marker(rt: Any, at: int) -> Path:
    name = hashlib.sha256(rt.run.uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"raylift-kill-in-reference-{name}-{at}"


def _kill(rt: Any, at: int) -> None:
    _marker(rt, at).touch()
    log.warning("%s: killing rank %d in the reference pass", KILL_IN_REFERENCE_ENV, rt.rank)
    for handler in logging.getLogger().handlers + logging.getLogger("trainer").handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
