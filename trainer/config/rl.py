"""`train.rl:` online RL (grpo, rloo): rollouts, rewards and the clipped policy loss.

Every name is TRL's (GRPOConfig, RLOOConfig 1.16), and so is every default but `beta`
under rloo (RLOOConfig's 0.05), so a team moving a TRL recipe over copies its numbers.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.config.base import _Section

RL_OBJECTIVES = ("grpo", "rloo")
"""Objectives that generate their own completions and learn from rewards."""

BUILTIN_REWARDS = ("math_answer", "format_regex", "length_target")
"""Rewards `trainer.rewards.builtin` implements, named in `function:` without a path."""

RL_BETA = {"grpo": 0.0, "rloo": 0.05}
"""beta when train.rl.beta is unset: GRPOConfig's 0.0 (no reference), RLOOConfig's 0.05."""

BUILTIN_OPTIONS = {
    "math_answer": ("column",),
    "format_regex": ("pattern",),
    "length_target": ("target", "unit"),
}

_PATH_FUNCTION = re.compile(r"^(?P<path>[^:]+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


class RewardSpec(_Section):
    function: str = Field(
        description="path/to/file.py:name (a Python function `(prompts, completions, "
        "**columns) -> list[float]`; the path absolute, or relative to where `raylift run` "
        "is typed, which makes it absolute at submit) "
        f"or a built-in: {', '.join(BUILTIN_REWARDS)}.",
    )
    weight: float = Field(default=1.0, description="This reward's weight in the summed reward.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of a built-in: math_answer {column: answer} (the "
        "reference answer's column); format_regex {pattern}; length_target {target, unit: "
        "tokens | chars} (docs: rl).",
    )

    @field_validator("function")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in BUILTIN_REWARDS or _PATH_FUNCTION.match(v):
            return v
        raise ValueError(
            f"{v!r} is neither path/to/file.py:function_name nor a built-in reward "
            f"({', '.join(BUILTIN_REWARDS)})"
        )

    @model_validator(mode="after")
    def _options(self) -> RewardSpec:
        """A built-in's options are checked here, on the laptop; a user's function takes
        none (its settings live in its file)."""
        allowed = BUILTIN_OPTIONS.get(self.function, ())
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise ValueError(
                f"options {unknown} are not options of {self.function} (it takes "
                f"{list(allowed) or 'none'})"
            )
        if self.function == "format_regex":
            try:
                re.compile(str(self.options.get("pattern", "")))
            except re.error as e:
                raise ValueError(f"format_regex: options.pattern is not a regex ({e})") from e
            if not self.options.get("pattern"):
                raise ValueError("format_regex needs options.pattern, e.g. '^<think>.*</think>'")
        if self.function == "length_target":
            target = self.options.get("target")
            if not isinstance(target, int) or target < 1:
                raise ValueError("length_target needs options.target, an integer >= 1")
            if self.options.get("unit", "tokens") not in ("tokens", "chars"):
                raise ValueError("length_target: options.unit is tokens or chars")
        return self

    @property
    def name(self) -> str:
        """The name its metric carries (`rewards/<name>/mean`): the function's own name."""
        m = _PATH_FUNCTION.match(self.function)
        return m.group("name") if m else self.function

    @property
    def location(self) -> tuple[str, str] | None:
        """(file, function name) of a user's reward; None for a built-in."""
        m = _PATH_FUNCTION.match(self.function)
        return (m.group("path"), m.group("name")) if m else None


class RLSection(_Section):
    num_generations: int = Field(
        default=8,
        ge=2,
        description="Completions sampled per prompt (a group); the global batch counts "
        "completions and must be a multiple of it.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        default="dapo",
        description="grpo: each completion's token mean, then the mean; bnpo: the micro "
        "batch's token mean; dr_grpo: the token sum over completions × max_completion_length; "
        "dapo: the token sum over the step's completion tokens (all ranks). grpo objective "
        "only (rloo's loss is per sequence).",
    )
    beta: float | None = Field(
        default=None,
        ge=0,
        description="KL strength against the reference (the base with the adapter off under "
        "lora/qlora, else a frozen copy). null: 0.0 for grpo (no reference), 0.05 for rloo "
        "(TRL's defaults).",
    )
    epsilon: float = Field(default=0.2, gt=0, description="Lower clip of the ratio: 1 - epsilon.")
    epsilon_high: float | None = Field(
        default=None,
        gt=0,
        description="Upper clip of the ratio: 1 + epsilon_high (DAPO: 0.28); null = epsilon.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group",
        description="grpo: advantages divided by the group's reward std, the batch's, or not "
        "at all (Dr. GRPO).",
    )
    normalize_advantages: bool = Field(
        default=False,
        description="rloo: normalise the leave-one-out advantages over the batch.",
    )
    num_iterations: int = Field(
        default=1,
        ge=1,
        description="Updates on each batch of completions (mu); past the first, the ratio "
        "is against the log-probs at sampling time.",
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_completion_length: int = Field(
        default=512, ge=1, description="Tokens a completion may have at most."
    )
    mask_truncated_completions: bool = Field(
        default=False,
        description="Leave completions that hit max_completion_length without EOS out of "
        "the loss (DAPO).",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="The reward functions, summed with their weights (at least one for an "
        "rl objective).",
    )
    reward_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds one reward call may take; past it the run stops naming the row.",
    )
    reward_workers: int = Field(
        default=0,
        ge=0,
        description="0: rewards run in the training process. N > 0: each worker's "
        "completions are split into up to N chunks, each scored by a Ray task (for rewards "
        "that execute code or call a service); a relative reward path is then read from the "
        "job's working directory on the task's node.",
    )
    reward_worker_cpus: float = Field(
        default=1.0,
        gt=0,
        description="CPUs each reward task asks Ray for (train.rl.reward_workers > 0).",
    )
    engine: Literal["generate"] = Field(
        default="generate",
        description="Rollout engine: generate (transformers' generate on the training "
        "workers, every strategy). vllm is not in this build.",
    )
    log_completions_every: int | None = Field(
        default=None,
        ge=1,
        description="Steps between samples of completions with their rewards written to "
        "completions.jsonl in the run folder; null = never.",
    )

    def beta_for(self, objective: str) -> float:
        return self.beta if self.beta is not None else RL_BETA[objective]

    @property
    def clip_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon
