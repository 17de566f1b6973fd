"""The rollout a checkpoint keeps: with num_iterations μ > 1 one rollout serves μ optimizer
steps, and a checkpoint taken inside that group cannot be resumed by sampling again, since
the weights that sampled it (and scored its `old` log-probs) were updated since. Each
rank writes the micro batches it holds (prompt and completion ids, masks, advantages, the
sampling-time and reference log-probs: exactly what its remaining steps train on) to
`rollout/rank_<r>.npz`, and a resumed rank trains on them as the uninterrupted run did.
A checkpoint at a group's boundary holds none: the next step samples anew from weights
the checkpoint restores bit for bit, with its seed a function of the step.

The arrays are written with numpy's npz (no pickle): the rank's manifest lists the file,
so a torn write keeps the checkpoint from counting as complete, as for every other part.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from trainer.errors import CheckpointError
from trainer.rollouts.feed import RolloutFeed

log = logging.getLogger(__name__)

FOLDER = "rollout"


def rollout_file(ckpt: Path, rank: int) -> Path:
    return ckpt / FOLDER / f"rank_{rank}.npz"


class RolloutPart:
    """A checkpoint part (trainer.checkpoint.manager.Stateful) over a rank's feed."""

    def __init__(self, feed: RolloutFeed):
        self.feed = feed

    def save(self, out: Path, rank: int) -> None:
        held = self.feed.held()
        if held is None:
            return  # at a group's boundary: the next step samples
        rollout, micro = held
        arrays: dict[str, np.ndarray] = {"rollout": np.array(rollout, dtype=np.int64)}
        for m, batch in enumerate(micro):
            arrays.update({f"m{m}_{j}": a for j, a in enumerate(batch)})
        path = rollout_file(out, rank)
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    def load(self, ckpt: Path, rank: int) -> None:
        path = rollout_file(ckpt, rank)
        if not path.exists():
            return  # saved at a boundary (or before rollouts were kept: the feed warns)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: the kept rollout is unreadable ({exc})") from None
        rollout = int(arrays.pop("rollout"))
        count = 1 + max(int(k[1:].split("_")[0]) for k in arrays)
        width = 1 + max(int(k.split("_")[1]) for k in arrays)
        micro = [tuple(arrays[f"m{m}_{j}"] for j in range(width)) for m in range(count)]
        self.feed.hold(rollout, micro)
        log.info("resuming inside rollout %d's group on its kept completions", rollout)
