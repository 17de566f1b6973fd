"""Online RL objectives: GRPO (with its Dr. GRPO, DAPO and BNPO normalisations) and RLOO.

A micro batch is completions the rollout (trainer.rollouts) already sampled, scored and
turned into advantages, with the log-probs of sampling time (`old`, when the ratio needs
them) and of the reference (`ref`, when beta > 0). Its loss is the clipped policy loss
over the completion tokens, each loss type's sum over the divisor `count` makes it, so a
step's gradient is TRL's (GRPOTrainer / RLOOTrainer) however the completions are split
into micro batches and ranks: dapo divides by the step's completion tokens over every
rank, grpo and dr_grpo by its completions, bnpo by each micro batch's own tokens (one
count per micro batch), rloo by its completions. tests/unit/rl checks it against TRL.

The per-token log-probs are the model's own logits at the completion positions over the
sampling temperature, as TRL scores them; entropy comes from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig
from trainer.objectives.base import TABLES, UPDATE_TOKENS
from trainer.objectives.sft import RouterTerm
from trainer.rollouts.drills import Drills
from trainer.rollouts.logps import completion_logps

BATCH = ("ids", "attention", "loss_mask", "advantages", "old", "ref")
"""A micro batch's arrays, in order: prompt + completion ids (prompts left-padded,
completions right-padded), their attention mask, the completion tokens the loss counts,
one advantage per completion, the sampling-time and the reference log-probs (per token;
for rloo `old` is per completion; empty arrays of width 0 when not needed)."""


@dataclass(frozen=True)
class LossSettings:
    """What the loss needs from train.rl, resolved once."""

    objective: str
    loss_type: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    max_completion_length: int
    temperature: float

    @classmethod
    def of(cls, cfg: JobConfig) -> LossSettings:
        rl = cfg.train.rl
        return cls(
            objective=cfg.train.objective,
            loss_type=rl.loss_type if cfg.train.objective == "grpo" else "rloo",
            beta=rl.beta_for(cfg.train.objective),
            epsilon_low=rl.epsilon,
            epsilon_high=rl.clip_high,
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
        )


def count_items(loss_type: str, loss_mask: np.ndarray) -> float:
    """A micro batch's share of the step's divisor (see the module docstring)."""
    if loss_type == "dapo":
        return float(loss_mask.sum())
    if loss_type == "bnpo":
        return 1.0
    return float(len(loss_mask))


def policy_loss(
    s: LossSettings,
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    num_items: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro batch's loss over `num_items`, sums for the metrics) from per-token
    log-probs with their graph. `old` None: the ratio is against these log-probs detached
    (one update per rollout); `ref` None: no KL term."""
    mask = mask.to(logps.dtype)
    if s.loss_type == "rloo":
        return _rloo_loss(s, logps, mask, advantages, old, num_items)
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    stats: dict[str, torch.Tensor] = {}
    if s.beta != 0.0:
        assert ref is not None, "beta > 0 needs the reference log-probs"
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + s.beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    masked = per_token * mask
    if s.loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_items
    elif s.loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / num_items
    elif s.loss_type == "dr_grpo":
        loss = masked.sum() / (num_items * s.max_completion_length)
    elif s.loss_type == "dapo":
        loss = masked.sum() / num_items
    else:
        raise ValueError(f"unknown loss_type {s.loss_type!r}")
    low = ((ratio < 1 - s.epsilon_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + s.epsilon_high) & (adv > 0)).to(mask.dtype)
    stats["clip_low"] = (low * mask).sum()
    stats["clip_high"] = (high * mask).sum()
    stats["clip_region"] = (torch.clamp(low + high, max=1.0) * mask).sum()
    stats["clip_count"] = mask.sum()
    return loss, stats


def _rloo_loss(
    s: LossSettings,
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    num_items: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO: one clipped ratio per completion (its summed log-probs against sampling
    time's); the KL is already in the advantages, as a reward penalty."""
    seq = (logps * mask).sum(1)
    old_seq = seq.detach() if old is None or old.numel() == 0 else old.reshape(-1)
    ratio = torch.exp(seq - old_seq)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).sum() / num_items
    low = ((ratio < 1 - s.epsilon_low) & (advantages < 0)).to(seq.dtype)
    high = ((ratio > 1 + s.epsilon_high) & (advantages > 0)).to(seq.dtype)
    n = torch.tensor(float(len(seq)), dtype=seq.dtype, device=seq.device)
    return loss, {
        "clip_low": low.sum(),
        "clip_high": high.sum(),
        "clip_region": torch.clamp(low + high, max=1.0).sum(),
        "clip_count": n,
    }


class GRPO:
    """The loop's objective for grpo and rloo: the feed samples, the loss learns."""

    def __init__(self, cfg: JobConfig):
        self.cfg, self.name = cfg, cfg.train.objective
        self.s = LossSettings.of(cfg)
        self.feed: Any = None
        self.rt: Any = None
        self._sums: torch.Tensor | None = None
        self._logged: list[dict[str, Any]] = []
        self.router = RouterTerm()
        self.model: Any = None
        self.drills: Any = Drills()  # the fault drills' hooks, no-ops unless armed
        self._micro = (-1, 0)  # (step, micro batches of it run so far), once armed
        self._in_update: Any = lambda: None  # the update's drill: nothing until armed

    def open_feed(self, train: list[str], eval_: list[str], rank: int, world: int) -> Any:
        from trainer.rollouts.feed import RolloutFeed
        from trainer.rollouts.prompts import read_prompts

        self.feed = RolloutFeed(self.cfg, read_prompts(train[0]), rank, world)
        return self.feed

    def before_training(self, strategy: Any, feed: Any, rt: Any) -> None:
        """The rollout's engine, tokenizer, rewards and reference, bound to the feed."""
        from trainer.rollouts.setup import bind_feed

        self.rt, self.model = rt, strategy.model
        bind_feed(self.cfg, strategy, feed)

    def arm_drills(self, drills: Any) -> None:
        """trainer.faults' drills inside the rollout and the update (a loss
        run without a feed, as the TRL oracle tests run it, is never armed)."""
        self.drills = self.feed.drills = drills
        self._in_update = self._count_micro

    def _count_micro(self) -> None:
        """The update's drill, told which micro batch of the feed's step comes next."""
        step, done = self._micro if self._micro[0] == self.feed.step else (self.feed.step, 0)
        self._micro = (step, done + 1)
        self.drills.in_update(step + 1, done, self.feed.micro_count)

    def checkpoint_parts(self) -> dict[str, Any]:
        """The rollout in hand when a checkpoint falls inside a num_iterations group."""
        from trainer.rollouts.state import RolloutPart

        return {"rollout": RolloutPart(self.feed)}

    def count(self, batch: tuple[np.ndarray, ...]) -> float:
        return count_items(self.s.loss_type, batch[2])

    def inputs(
        self, batch: tuple[np.ndarray, ...], device: torch.device, attend: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        ids, attention, mask, adv, old, ref = (
            torch.from_numpy(a).to(device, non_blocking=True) for a in batch
        )
        return (
            ids,
            mask,
            {
                "attention": attention,
                "advantages": adv,
                "old": old if old.shape[1] else None,
                "ref": ref if ref.shape[1] else None,
            },
        )

    def loss(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        num_items: Any,
        attention: torch.Tensor | None = None,
        advantages: torch.Tensor | None = None,
        old: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        assert attention is not None and advantages is not None
        self._in_update()  # a kill drill: the earlier micro batches' backward done
        with self.router.recording(model) as routed:  # a mixture of experts' aux loss
            logps, entropy = completion_logps(
                model, x, attention, y.shape[1], self.s.temperature, entropy=True
            )
        loss, stats = policy_loss(self.s, logps, y, advantages, old, ref, num_items)
        share = count_items(self.s.loss_type, y)
        loss = loss + self.router.term(model, routed, share, num_items, attention)
        assert entropy is not None
        mask = y.to(entropy.dtype)
        tokens = mask.sum()
        zero = torch.zeros((), device=tokens.device)
        sums = torch.stack(
            [
                tokens,
                stats.get("kl", zero),
                (entropy.detach() * mask).sum(),
                stats["clip_count"],
                stats["clip_low"],
                stats["clip_high"],
                stats["clip_region"],
                attention.sum(),  # the update's real tokens: prompt + completion
            ]
        ).double()
        self._sums = sums if self._sums is None else self._sums + sums
        return loss

    def metrics(self, all_reduce: Any) -> dict[str, float]:
        """TRL's names over every rank since the last report: the rollouts' reward,
        reward_std, rewards/<name>/mean, completions/mean_length and clipped_ratio; the
        loss's kl (beta > 0), entropy and clip ratios. Collective."""
        stats, self.feed.stats = self.feed.stats, []
        names = self.feed.rewards.names
        local = [
            sum(s.completions for s in stats),
            sum(s.reward_sum for s in stats),
            sum(s.reward_sq for s in stats),
            sum(s.length_sum for s in stats),
            sum(s.truncated for s in stats),
            sum(s.kl_sum for s in stats),
            sum(s.kl_tokens for s in stats),
            1.0,  # this worker: the split's seconds are means over the workers
            sum(s.generate_s for s in stats),
            sum(s.reward_s for s in stats),
            sum(s.logps_s for s in stats),
            sum(s.prompt_tokens for s in stats),
            *[sum(s.per_function[j] for s in stats) for j in range(len(names))],
            *(self._sums.tolist() if self._sums is not None else [0.0] * 8),
        ]
        self._sums = None
        n, r, r2, length, truncated, rollout_kl, rollout_tokens, *rest = all_reduce(local)
        workers, generate_s, reward_s, logps_s, prompt_tokens, *rest = rest
        per_function, (tokens, kl, entropy, clip_n, low, high, region, update_tokens) = (
            rest[: len(names)],
            rest[len(names) :],
        )
        samples = [x for s in stats for x in s.samples]
        self._log_completions(samples)
        aux: dict[str, Any] = self.router.metrics(all_reduce)
        aux.update(self.drills.digests(self.model, [s.completions_sha for s in stats]))
        if update_tokens:  # tokens_per_s and MFU count these (trainer.observability.steps)
            aux[UPDATE_TOKENS] = update_tokens
        if samples and self.rt is not None and self.rt.rank == 0:
            aux[TABLES] = {"completions": completion_rows(samples, names)}
        if not n:
            return aux
        out = {
            **aux,
            "tokens/rollout": prompt_tokens + length,
            "reward": r / n,
            "reward_std": max(r2 - r * r / n, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5,
            "completions/mean_length": length / n,
            "completions/clipped_ratio": truncated / n,
        }
        out.update({f"rewards/{k}/mean": v / n for k, v in zip(names, per_function, strict=True)})
        if generate_s:  # a step that sampled (num_iterations > 1 reuses a rollout)
            out["rollout/generate_s"] = generate_s / workers
            out["rollout/reward_s"] = reward_s / workers
            out["rollout/logps_s"] = logps_s / workers
            out["rollout/tokens_per_s"] = length / (generate_s / workers)
        if tokens:
            out["entropy"] = entropy / tokens
            if self.s.beta != 0.0 and self.s.loss_type != "rloo":
                out["kl"] = kl / tokens
        if self.s.beta != 0.0 and self.s.loss_type == "rloo" and rollout_tokens:
            out["kl"] = rollout_kl / rollout_tokens  # TRL's rloo: at sampling, first order
        if clip_n:
            out["clip_ratio/low_mean"] = low / clip_n
            out["clip_ratio/high_mean"] = high / clip_n
            out["clip_ratio/region_mean"] = region / clip_n
        return out

    def _log_completions(self, samples: list[dict[str, Any]]) -> None:
        """Rank 0's sample of completions with their rewards, the whole file rewritten
        (object stores cannot append): completions.jsonl in the run folder. A resumed
        attempt first takes over the earlier attempts' rows of the steps before its
        first sample (the steps it trains again it logs anew), so a restart keeps them."""
        if not samples or self.rt is None or self.rt.rank != 0:
            return
        import json

        loc = self.rt.run.join("completions.jsonl")
        if not self._logged and loc.fs.get_file_info(loc.path).is_file:
            with loc.fs.open_input_stream(loc.path) as f:
                earlier = [json.loads(line) for line in f.read().decode().splitlines() if line]
            self._logged = [r for r in earlier if r["step"] < samples[0]["step"]]
        self._logged.extend(samples)
        body = "".join(json.dumps(s) + "\n" for s in self._logged)
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(body.encode())


def completion_rows(samples: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """completions.jsonl's samples as a tracker table's flat rows: a chat prompt as its
    JSON text, each reward function's value in a column of its own (`reward/<name>`)."""
    import json

    rows = []
    for x in samples:
        prompt = x["prompt"] if isinstance(x["prompt"], str) else json.dumps(x["prompt"])
        row = {k: x[k] for k in ("step", "rank")}
        row.update(prompt=prompt, completion=x["completion"], reward=float(x["reward"]))
        row.update({f"reward/{k}": float(x["rewards"][k]) for k in names})
        rows.append(row)
    return rows
