"""What a rank's training state needs across a (dp, pp, tp) device mesh: one optimizer
over the several pipeline stages a rank may hold, and the global gradient norm (and its
clipping) over shards that live on different mesh dims. FSDP's (trainer.strategies.fsdp),
apart from how it builds, steps and saves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class OptimizerGroup(torch.optim.Optimizer):
    """One optimizer per pipeline stage on this rank (DCP keeps one per model part), seen
    as one by the loop's LR scheduler: its param_groups are theirs (the same dicts)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]
        self.defaults = optimizers[0].defaults
        self._optimizer_step_pre_hooks = {}  # type: ignore[assignment]
        self._optimizer_step_post_hooks = {}  # type: ignore[assignment]

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:  # what memory accounting reads
        return {p: st for opt in self.optimizers for p, st in opt.state.items()}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def clip_grad_norm_mesh(
    params: list[torch.nn.Parameter], max_norm: float | None, replicas: int
) -> torch.Tensor:
    """The global gradient norm over every mesh dim, and clipping to `max_norm`.

    `clip_grad_norm_` cannot stack norms of DTensors on different meshes (TP weights on
    (dp, tp), norms and embeddings on dp only), and knows nothing of the pipeline. So:
    each rank sums the squares of its local shards, each weighted by the share of the
    stage's `replicas` (dp × tp) workers that hold that very shard (a weight sharded over
    dp and tp: 1; a norm weight sharded over dp only: 1/tp), and one all-reduce over all
    ranks adds the stages up."""
    grads = []
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is None:
            continue
        pieces = 1
        if hasattr(g, "to_local"):
            mesh, placements = g.device_mesh, g.placements
            for i, pl in enumerate(placements):
                # Shard, or FSDP's _StridedShard over a TP shard (which is not is_shard()).
                if not pl.is_replicate():
                    pieces *= mesh.size(i)
            g = g.to_local()
        grads.append(g)
        sq = sq.to(g.device)
        sq += g.detach().double().pow(2).sum() * (pieces / replicas)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    # On the device: the step report reads the norm when it writes a record (issue 47: a
    # host read here made every step wait for the GPU). Where the host's test `coef < 1`
    # failed (NaN included) the coefficient is 1, which leaves every gradient as it was.
    norm = sq.sqrt()
    if max_norm is not None and grads:
        coef = max_norm / (norm + 1e-6)
        coef = torch.where(coef < 1.0, coef, torch.ones_like(coef)).to(grads[0].dtype)
        torch._foreach_mul_(grads, coef)
    return norm
