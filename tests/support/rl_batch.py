"""A fixed batch of prompts and completions on the tiny Llama, laid out as TRL's GRPO
trainer holds one (prompts left-padded, completions right-padded after their EOS), and
TRL's own trainers as the loss oracle: a stand-in holding only what their
`_compute_loss` reads, so the test calls TRL's code, not a copy of it."""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

PAD, EOS, VOCAB = 0, 1, 64
ROWS = [  # (prompt length, completion length incl. EOS, ends with EOS)
    (3, 5, True),
    (5, 2, True),
    (2, 7, False),
    (4, 4, True),
    (5, 1, True),
    (1, 6, True),
]


@dataclass
class RLBatch:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    def rows(self, index: list[int]) -> RLBatch:
        return RLBatch(*(getattr(self, f)[index] for f in self.__dataclass_fields__))


def rl_batch(seed: int = 7) -> RLBatch:
    g = torch.Generator().manual_seed(seed)
    n, p_max, c_max = len(ROWS), max(r[0] for r in ROWS), max(r[1] for r in ROWS)
    prompt = torch.full((n, p_max), PAD)
    pmask = torch.zeros((n, p_max), dtype=torch.long)
    comp = torch.full((n, c_max), PAD)
    cmask = torch.zeros((n, c_max), dtype=torch.long)
    for i, (p, c, eos) in enumerate(ROWS):
        prompt[i, p_max - p :] = torch.randint(2, VOCAB, (p,), generator=g)
        pmask[i, p_max - p :] = 1
        comp[i, :c] = torch.randint(2, VOCAB, (c,), generator=g)
        if eos:
            comp[i, c - 1] = EOS
        cmask[i, :c] = 1
    return RLBatch(prompt, pmask, comp, cmask)


def grpo_stand_in(model, loss_type: str, beta: float, accum: int = 1, max_len: int = 7, **kw):
    """A stand-in GRPOTrainer: `GRPOTrainer._compute_loss(trainer, model, inputs)`."""
    from accelerate import Accelerator
    from trl import GRPOTrainer

    t = SimpleNamespace(
        model=model,
        accelerator=Accelerator(cpu=True),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=kw.get("epsilon", 0.2),
        epsilon_high=kw.get("epsilon_high", kw.get("epsilon", 0.2)),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=accum,
        max_completion_length=max_len,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum),
    )
    t._get_per_token_logps_and_entropies = functools.partial(
        GRPOTrainer._get_per_token_logps_and_entropies, t
    )
    return t


def rloo_stand_in(model, **kw):
    from accelerate import Accelerator
    from trl import RLOOTrainer

    t = SimpleNamespace(
        model=model,
        accelerator=Accelerator(cpu=True),
        aux_loss_enabled=False,
        epsilon_low=kw.get("epsilon", 0.2),
        epsilon_high=kw.get("epsilon_high", kw.get("epsilon", 0.2)),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    t._get_per_token_logps_and_entropies = functools.partial(
        RLOOTrainer._get_per_token_logps_and_entropies, t
    )
    return t
