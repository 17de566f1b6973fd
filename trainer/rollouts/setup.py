"""Binding a rollout feed to its worker before step 1: the tokenizer, the `generate`
engine over the strategy's model, the reward functions, and the log-prob functions the
rollout keeps (the policy's at sampling time, the reference's when beta > 0).

The reference is the base with its adapter switched off under lora/qlora (one model in
memory), else a frozen copy of the starting weights (the strategy's `frozen_copy`):
sharded as the policy under FSDP2, partitioned in an engine of its own under ZeRO-3, whole
on the worker under DDP and ZeRO-2; the planner counts it (trainer.planner.rollouts)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import JobConfig
from trainer.rewards.runner import Rewards
from trainer.rollouts.feed import LogpsFn, RolloutFeed
from trainer.rollouts.generate import GenerateEngine, Sampling, unwrap
from trainer.rollouts.logps import completion_logps
from trainer.rollouts.rows import PromptRow


def prompt_tokenizer(tok: Any, chat_template: str | None) -> Callable[[PromptRow], list[int]]:
    """A prompt's ids: text through the tokenizer (its BOS), chat messages through the
    chat template with the assistant's turn opened."""

    def tokenize(row: PromptRow) -> list[int]:
        if isinstance(row.prompt, str):
            return list(tok(row.prompt)["input_ids"])
        text = tok.apply_chat_template(
            row.prompt, tokenize=False, add_generation_prompt=True, chat_template=chat_template
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return tokenize


def _logps_fn(
    model: torch.nn.Module, strategy: Any, temperature: float, micro: int, off: Any = None
) -> LogpsFn:
    """No-grad per-token log-probs in micro-batch chunks, under the strategy's precision
    (and `off`, a context that switches the adapter off for the reference)."""

    def run(ids: np.ndarray, attention: np.ndarray, width: int) -> np.ndarray:
        out = []
        with torch.no_grad(), strategy.precision(), off() if off else contextlib.nullcontext():
            for s in range(0, len(ids), micro):
                x = torch.from_numpy(ids[s : s + micro]).to(strategy.device)
                a = torch.from_numpy(attention[s : s + micro]).to(strategy.device)
                out.append(completion_logps(model, x, a, width, temperature)[0].float().cpu())
        return torch.cat(out).numpy()

    return run


def frozen_copy(strategy: Any) -> torch.nn.Module:
    """The full-fine-tuning reference: the starting weights, frozen (bind_feed runs before
    a resume loads its checkpoint). A sharded strategy builds its own (FSDP2: sharded as
    the policy, so its forward gathers as the policy's does; ZeRO-3 partitioned in an
    engine of its own); a whole model is copied."""
    if hasattr(strategy, "frozen_copy"):
        return strategy.frozen_copy()
    return copy.deepcopy(unwrap(strategy.model)).requires_grad_(False)


def bind_feed(cfg: JobConfig, strategy: Any, feed: RolloutFeed) -> None:
    from trainer.data.tokenize import read_chat_template
    from trainer.model.folders import local_tokenizer_dir
    from trainer.model.loading import load_tokenizer

    rl = cfg.train.rl
    tok = load_tokenizer(local_tokenizer_dir(cfg), cfg.model.special_tokens)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    sampling = Sampling(rl.temperature, rl.top_p, rl.max_completion_length, eos, pad)
    # FSDP2's and ZeRO-3's forwards gather each layer's shards: every rank decodes as
    # many steps (ZeRO-3's gathers are its engine's module hooks, which generate runs too)
    synced = (
        (cfg.strategy.name == "fsdp" or getattr(strategy, "stage", 0) == 3)
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    engine = GenerateEngine(strategy.model, sampling, strategy.device, synced)
    rewards = Rewards(
        rl.rewards, rl.reward_timeout_s, Path.cwd(), rl.reward_workers, rl.reward_worker_cpus
    )
    micro = cfg.train.micro_batch_size
    policy = _logps_fn(strategy.model, strategy, rl.temperature, micro)
    reference = None
    if rl.beta_for(cfg.train.objective) != 0.0:
        if cfg.model.adapter != "none":
            peft = unwrap(strategy.model)
            reference = _logps_fn(peft, strategy, rl.temperature, micro, peft.disable_adapter)
        else:
            reference = _logps_fn(frozen_copy(strategy), strategy, rl.temperature, micro)
    template = read_chat_template(cfg.data.chat_template)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    feed.bind(
        engine,
        prompt_tokenizer(tok, template),
        decode,
        rewards,
        policy,
        reference,
        strategy.device,
    )
