"""What online RL's rollouts add to a plan (train.objective grpo, rloo): the `generate`
engine's KV cache on each rank, a full-fine-tuning reference's frozen copy (beta > 0
without an adapter), and the rollout's share of a step's compute.

Sizes: a rank samples global_batch / num_generations / world prompts, num_generations
completions each, in one `generate` call, so its KV cache holds 2 (K and V) × layers ×
kv_heads × head_dim × the compute dtype's bytes for each of completions × (prompt +
max_completion_length) tokens. Prompts have no length limit of their own (TRL 1.16's
GRPOConfig has none either): they are counted at data.block_size, the bound the job's
other rows have, so the figure is an upper bound for shorter prompts.

Compute: a rollout (one every num_iterations optimizer steps) prefills and decodes every
completion, 2·M FLOPs a token (M the active parameters), and scores them again without
grad for the sampling-time log-probs (num_iterations > 1) and the reference (beta > 0);
the updates train num_iterations × those tokens. From the layout's training throughput
the rollout's seconds are a lower bound: decoding a token at a time is memory-bound, not
compute-bound, so the run's own rollout/generate_s is the figure to trust.

Pure arithmetic over the shape and the setup, like the rest of the planner: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import JobConfig
from trainer.planner.preference import GIB, flops_factor, reference_weight_bytes
from trainer.planner.setup import Setup
from trainer.planner.shape import ModelShape

RL_OBJECTIVES = ("grpo", "rloo")


@dataclass(frozen=True)
class RolloutCost:
    prompts_per_rank: int
    completions_per_rank: int
    tokens_per_completion: int
    """Prompt (counted at data.block_size) + max_completion_length."""
    kv_cache_gib_per_rank: float
    reference_gib_per_rank: float
    """A frozen copy of the starting weights (full fine-tuning with beta > 0), else 0."""
    rollout_share: float
    """The rollout's share of the compute of one rollout and its num_iterations updates."""
    rollout_s_per_step: float | None
    """Its seconds per optimizer step at the layout's throughput (a lower bound)."""


def kv_cache_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> float:
    """Keys and values of every layer for `tokens` positions."""
    head_dim = shape.head_dim or shape.hidden // shape.heads
    return 2.0 * shape.layers * shape.kv_heads * head_dim * dtype_bytes * tokens


def cost(
    cfg: JobConfig, shape: ModelShape, setup: Setup, tokens_per_s: float | None
) -> RolloutCost | None:
    """None unless the objective samples. `tokens_per_s` is the whole layout's training
    throughput (tokens a second at the training FLOPs per token)."""
    objective = cfg.train.objective
    if objective not in RL_OBJECTIVES:
        return None
    rl = cfg.train.rl
    world = max(setup.world, 1)
    completions = cfg.global_batch // world
    per_completion = cfg.data.block_size + rl.max_completion_length
    kv = kv_cache_bytes(shape, completions * per_completion, setup.c)
    beta = rl.beta_for(objective) != 0.0
    frozen = beta and setup.adapter == "none"
    reference = reference_weight_bytes(shape.params, setup) if frozen else 0.0
    # FLOPs per token and active parameter over one rollout and its updates.
    train = flops_factor(setup.adapter, setup.checkpointing) * rl.num_iterations
    rollout = 2.0 * (1 + (rl.num_iterations > 1) + beta)
    share = rollout / (rollout + train)
    seconds = None
    if tokens_per_s:
        step_tokens = cfg.global_batch * per_completion
        train_step = flops_factor(setup.adapter, setup.checkpointing)
        seconds = step_tokens * rollout / train_step / tokens_per_s / rl.num_iterations
    return RolloutCost(
        prompts_per_rank=completions // rl.num_generations,
        completions_per_rank=completions,
        tokens_per_completion=per_completion,
        kv_cache_gib_per_rank=kv / GIB,
        reference_gib_per_rank=reference / GIB,
        rollout_share=share,
        rollout_s_per_step=seconds,
    )


def notes(c: RolloutCost | None) -> list[str]:
    """The plan's lines for an online RL objective."""
    if c is None:
        return []
    groups = c.completions_per_rank // max(c.prompts_per_rank, 1)
    out = [
        f"rollouts: {c.prompts_per_rank} prompts × {groups} generations a rank, up to "
        f"{c.tokens_per_completion} tokens each (prompts counted "
        f"at data.block_size): a KV cache of {c.kv_cache_gib_per_rank:.2f} GiB per rank "
        "while sampling",
        f"rollouts: at least {c.rollout_share:.0%} of the compute"
        + (
            f", ≥ {c.rollout_s_per_step:.1f} s a step at the layout's throughput"
            if c.rollout_s_per_step is not None
            else ""
        )
        + " (decoding is memory-bound: the run's rollout/generate_s says how much more)",
    ]
    if c.reference_gib_per_rank:
        out.append(
            f"reference: a frozen copy of the starting weights, "
            f"{c.reference_gib_per_rank:.2f} GiB per rank (beta > 0 in full fine-tuning)"
        )
    return out
