"""One call that scores a model on task specs (trainer.evaluation.specs) with
`lm_eval.simple_evaluate`, and the scores it gives as the run's metric names."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

from trainer.evaluation.specs import is_path, resolve


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """lm-eval seeds python's, numpy's and torch's global RNGs; the run's streams (dropout,
    data order) continue afterwards exactly where they were, so a resumed run stays exact."""
    import numpy as np
    import torch

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def evaluate(
    lm: Any, specs: Sequence[str], limit: int | None = None, log_samples: bool = False
) -> dict[str, Any] | None:
    """lm-eval's results for `lm` (an `LM`, or "hf" with model_args) on `specs`; None on a
    process lm-eval leaves without results (a local rank other than 0)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names, folders = resolve(specs)
    manager = TaskManager(
        include_path=folders or None, include_defaults=any(not is_path(s) for s in specs)
    )
    with rng_kept():
        return simple_evaluate(
            model=lm,
            tasks=names,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=0,
            log_samples=log_samples,
        )


def scores(results: dict[str, Any]) -> dict[str, float]:
    """`eval/<task>/<metric>` from lm-eval's results (a filter other than `none` joins
    the metric's name: eval/gsm8k/exact_match/strict-match); no stderr."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}/{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out
