"""The RL objectives' feed: each step's prompts, sampled, scored and laid out as micro
batches the loss reads (trainer.objectives.grpo.BATCH).

A step's global batch counts completions: `global_batch / num_generations` prompts, each
worker sampling whole groups of its share. Prompts are drawn in a seeded permutation per
epoch, a pure function of the step, like every other feed, so a resumed run reads the
same prompts and (seeded per rollout and worker) samples the same completions. With num_iterations
μ > 1 one rollout serves μ optimizer steps (TRL's reuse), its log-probs at sampling time
kept for the ratio. A checkpoint inside such a group keeps the rollout itself
(trainer.rollouts.state.RolloutPart): the weights that sampled it are gone by then.

Rewards are gathered over every worker before advantages are made (TRL normalises the
whole batch), then each worker keeps its own. Prompts are left-padded and completions
right-padded to the worker's longest, as TRL pads a generation batch, then split.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.config import JobConfig
from trainer.errors import UserError
from trainer.rollouts.advantages import grpo_advantages, rloo_advantages
from trainer.rollouts.drills import Drills
from trainer.rollouts.generate import GenerateEngine, sample_seed
from trainer.rollouts.rows import PromptRow

log = logging.getLogger(__name__)

LogpsFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
"""(ids, attention, completion width) → per-token log-probs, no grad (policy or reference)."""


@dataclass
class RolloutStats:
    """What one rollout measured on this worker, summed for the metrics."""

    completions: float = 0.0
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    per_function: list[float] = field(default_factory=list)
    length_sum: float = 0.0
    prompt_tokens: float = 0.0  # each completion's prompt, counted once per completion
    truncated: float = 0.0
    kl_sum: float = 0.0  # rloo with beta > 0: sum of (sampling - reference) log-probs
    kl_tokens: float = 0.0
    generate_s: float = 0.0  # the step's split: sampling, scoring, log-probs kept
    reward_s: float = 0.0
    logps_s: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    completions_sha: str = ""  # this worker's completion ids (the drills compare attempts)


class _FirstPrompt:
    """The final probe's fixed input (loop._write_probe): the first prompt's tokens."""

    def __init__(self, ids: list[int]):
        self.ids = np.array([ids[:16] or [0]], dtype=np.int64)

    def gather(self, index: np.ndarray) -> tuple[np.ndarray]:
        return (self.ids,)


class RolloutFeed:
    attention = "causal"

    def __init__(self, cfg: JobConfig, rows: list[PromptRow], rank: int, world: int):
        self.cfg, self.rows, self.rl = cfg, rows, cfg.train.rl
        self.rank, self.world = rank, world
        self.global_batch = cfg.global_batch
        self.prompts_per_step = self.global_batch // self.rl.num_generations
        self.per_worker = self.prompts_per_step // world
        rollouts = len(rows) // self.prompts_per_step
        if rollouts < 1:
            raise UserError(
                f"data.train_file: {len(rows)} prompts are fewer than one step's "
                f"{self.prompts_per_step} (global batch {self.global_batch} / num_generations "
                f"{self.rl.num_generations}); add prompts or lower the batch"
            )
        self.steps_per_epoch = rollouts * self.rl.num_iterations
        self._cache: tuple[int, list[tuple[np.ndarray, ...]]] | None = None
        self.stats: list[RolloutStats] = []
        self.first: Any = None
        self.step = -1  # the step (0-based) whose micro batches were asked for last
        self.drills: Any = Drills()  # fault drills' hooks (trainer.faults)

    # ---------------------------------------------------------------- set-up

    def bind(
        self,
        engine: GenerateEngine,
        tokenize: Callable[[PromptRow], list[int]],
        decode: Callable[[list[int]], str],
        rewards: Any,
        policy_logps: LogpsFn,
        reference_logps: LogpsFn | None,
        device: torch.device,
    ) -> None:
        """What a rollout needs from the worker (before step 1)."""
        self.engine, self.tokenize, self.decode, self.rewards = engine, tokenize, decode, rewards
        self.policy_logps, self.reference_logps, self.device = (
            policy_logps,
            reference_logps,
            device,
        )
        self.first = _FirstPrompt(tokenize(self.rows[0]))

    # ---------------------------------------------------------------- the plan

    def prompt_indices(self, rollout: int) -> list[int]:
        """This worker's prompts at a rollout: a slice of the epoch's permutation."""
        per_epoch = self.steps_per_epoch // self.rl.num_iterations
        epoch, within = divmod(rollout, per_epoch)
        order = np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.rows))
        step = order[within * self.prompts_per_step : (within + 1) * self.prompts_per_step]
        return [
            int(i) for i in step[self.rank * self.per_worker : (self.rank + 1) * self.per_worker]
        ]

    def source_tokens(self, done: int) -> dict[str, int]:
        return {}

    def micro_batches(self, step: int) -> list[tuple[np.ndarray, ...]]:
        self.step = step
        rollout = step // self.rl.num_iterations
        if self._cache is None or self._cache[0] != rollout:
            if step % self.rl.num_iterations:
                log.warning(
                    "step %d resumes inside rollout %d's group (train.rl.num_iterations %d) "
                    "but its checkpoint holds no rollout (trainer.rollouts.state): sampling "
                    "it again with the current weights, so this group is not exact",
                    step + 1, rollout, self.rl.num_iterations,
                )  # fmt: skip
            self._cache = (rollout, self._rollout(rollout, step))
        return self._cache[1]

    @property
    def micro_count(self) -> int:
        """Micro batches of the step being trained (its rollout's)."""
        return len(self._cache[1]) if self._cache is not None else 0

    def held(self) -> tuple[int, list[tuple[np.ndarray, ...]]] | None:
        """(rollout, its micro batches) when the step after the last one trained reuses the
        rollout in hand (inside a num_iterations group), else None: what a checkpoint
        must keep for the resumed step to train on the same rollout."""
        if self._cache is None or self._cache[0] != (self.step + 1) // self.rl.num_iterations:
            return None
        return self._cache

    def hold(self, rollout: int, micro: list[tuple[np.ndarray, ...]]) -> None:
        """A checkpoint's rollout: the resumed steps of its group train on it."""
        self._cache = (rollout, micro)

    # ---------------------------------------------------------------- a rollout

    def _rollout(self, rollout: int, step: int) -> list[tuple[np.ndarray, ...]]:
        g, rl = self.rl.num_generations, self.rl
        rows = [self.rows[i] for i in self.prompt_indices(rollout)]
        prompt_ids = [self.tokenize(r) for r in rows]
        t0 = time.perf_counter()
        seed = sample_seed(self.cfg.train.seed, rollout, self.rank)
        completion_ids = self.engine.sample(prompt_ids, g, seed)
        t1 = time.perf_counter()
        self.drills.in_rollout(step + 1)  # a kill drill: sampled, not yet scored
        texts = [self.decode(c) for c in completion_ids]
        prompts = [r.prompt for r in rows for _ in range(g)]
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        columns = {k: [r.columns.get(k) for r in rows for _ in range(g)] for k in rows[0].columns}
        values = np.array(
            self.rewards.score(prompts, completions, columns, completion_ids), dtype=np.float64
        )
        reward = values @ np.array(self.rewards.weights, dtype=np.float64)
        t2 = time.perf_counter()
        ids, attention, mask, width = self._layout(
            [p for p in prompt_ids for _ in range(g)], completion_ids
        )
        old = ref = np.zeros((len(ids), 0), dtype=np.float32)
        if rl.num_iterations > 1 or self.cfg.train.objective == "rloo":
            old = self.policy_logps(ids, attention, width)
        if self.reference_logps is not None:
            ref = self.reference_logps(ids, attention, width)
        t3 = time.perf_counter()
        advantages = self._advantages(reward, old, ref, mask)
        kl = float(((old - ref) * mask).sum()) if ref.shape[1] and old.shape[1] else 0.0
        if self.cfg.train.objective == "rloo":
            old = (old * mask).sum(1, keepdims=True).astype(np.float32)
        self._record(step, values, reward, completion_ids, mask, prompts, texts, kl)
        self.stats[-1].prompt_tokens = float(g * sum(len(p) for p in prompt_ids))
        self.stats[-1].completions_sha = hashlib.sha256(str(completion_ids).encode()).hexdigest()
        self.stats[-1].generate_s, self.stats[-1].reward_s, self.stats[-1].logps_s = (
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )
        micro = self.cfg.train.micro_batch_size
        parts = (ids, attention, mask, advantages.astype(np.float32), old, ref)
        return [tuple(a[s : s + micro] for a in parts) for s in range(0, len(ids), micro)]

    def _layout(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids, attention, loss mask, completion width): prompts left-padded, completions
        right-padded; a truncated completion is masked out if mask_truncated_completions."""
        pad, eos = self.engine.s.pad_id, self.engine.s.eos_id
        p_w = max(len(p) for p in prompts)
        c_w = max(max(len(c) for c in completions), 1)
        n = len(prompts)
        ids = np.full((n, p_w + c_w), pad, dtype=np.int64)
        attention = np.zeros((n, p_w + c_w), dtype=np.int64)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            ids[i, p_w - len(p) : p_w] = p
            ids[i, p_w : p_w + len(c)] = c
            attention[i, p_w - len(p) : p_w + len(c)] = 1
            if self.rl.mask_truncated_completions and (not c or c[-1] != eos):
                attention[i, p_w:] = 0
        return ids, attention, attention[:, p_w:].copy(), c_w

    def _advantages(
        self, reward: np.ndarray, old: np.ndarray, ref: np.ndarray, mask: np.ndarray
    ) -> np.ndarray:
        """Advantages over the whole step's rewards (all workers), this worker's slice."""
        rl, g = self.rl, self.rl.num_generations
        r = torch.from_numpy(reward)
        kl = None
        if self.cfg.train.objective == "rloo" and ref.shape[1]:
            kl = torch.from_numpy(((old - ref) * mask).sum(1).astype(np.float64))
        everyone = self._gather(r if kl is None else torch.stack([r, kl], 1))
        if self.cfg.train.objective == "grpo":
            adv = grpo_advantages(everyone, g, rl.scale_rewards)
        else:
            rewards, kls = (everyone, None) if kl is None else (everyone[:, 0], everyone[:, 1])
            beta = rl.beta_for("rloo")
            adv = rloo_advantages(rewards, g, rl.normalize_advantages, kls, beta)
        n = len(reward)
        return adv[self.rank * n : (self.rank + 1) * n].numpy()

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world == 1 or not dist.is_initialized():
            return local
        t = local.to(self.device)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts).cpu()

    def _record(self, step, values, reward, completion_ids, mask, prompts, texts, kl) -> None:
        every = self.rl.log_completions_every
        samples = []
        if every and (step + 1) % every == 0:
            samples = [
                {
                    "step": step + 1,
                    "rank": self.rank,
                    "prompt": p,
                    "completion": t,
                    "reward": float(r),
                    "rewards": dict(zip(self.rewards.names, map(float, v), strict=True)),
                }
                for p, t, r, v in list(zip(prompts, texts, reward, values, strict=True))[:4]
            ]
        eos = self.engine.s.eos_id
        self.stats.append(
            RolloutStats(
                completions=float(len(reward)),
                reward_sum=float(reward.sum()),
                reward_sq=float((reward**2).sum()),
                per_function=values.sum(0).tolist(),
                length_sum=float(sum(len(c) for c in completion_ids)),
                truncated=float(sum(1 for c in completion_ids if not c or c[-1] != eos)),
                kl_sum=kl,
                kl_tokens=float(mask.sum()),
                samples=samples,
            )
        )
