"""`train:` and `optim:` the steps, the objective and its options, precision and loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.config.base import _Section
from trainer.config.rl import RLSection


class OptimSection(_Section):
    name: Literal["adamw", "adamw8bit"] = Field(
        default="adamw",
        description="adamw8bit: bitsandbytes 8-bit AdamW states (about 1/4 the memory).",
    )
    lr: float = Field(default=3e-4, gt=0, description="Peak learning rate (AdamW).")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="After warmup: cosine to min_lr_ratio, linear to 0, or flat."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Floor of cosine/linear.")
    weight_decay: float = Field(
        default=0.0, ge=0, description="On matrices only; not on biases and norms."
    )
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float | None = Field(default=1.0, gt=0, description="Max grad norm; null = off.")


OBJECTIVES = ("sft", "dpo", "ipo", "hinge", "simpo", "orpo", "kto", "grpo", "rloo")
"""Training objectives (trainer.objectives): what a batch is and how its loss is made."""
Objective = Literal["sft", "dpo", "ipo", "hinge", "simpo", "orpo", "kto", "grpo", "rloo"]

PREFERENCE_BETA = {"dpo": 0.1, "ipo": 0.1, "hinge": 0.1, "simpo": 2.0, "orpo": 0.1, "kto": 0.1}
"""beta when train.preference.beta is unset: TRL's DPOConfig (0.1; for IPO its tau),
ORPOConfig (lambda, 0.1) and KTOConfig (0.1), the SimPO paper's 2.0."""


class PreferenceSection(_Section):
    beta: float | None = Field(
        default=None,
        gt=0,
        description="dpo/hinge/kto: the KL strength; ipo: the regularisation tau; simpo: the "
        "reward scale; orpo: lambda, the odds-ratio weight. null: 0.1 (dpo, ipo, hinge, "
        "orpo, kto: TRL's defaults), 2.0 (simpo: the SimPO paper's).",
    )
    simpo_gamma: float = Field(
        default=1.0,
        ge=0,
        description="simpo: the target reward margin gamma (the paper's gamma/beta = 0.5 "
        "with beta 2.0).",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="dpo and simpo: the probability that a pair's labels are flipped "
        "(conservative DPO); 0 is the plain loss.",
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="A pair longer than data.block_size first loses prompt tokens from the "
        "left down to this many (default: half of block_size), then both completions are cut "
        "on the right to fit. Chosen and rejected always keep the same prompt.",
    )
    desirable_weight: float = Field(
        default=1.0,
        gt=0,
        description="kto: the weight of desirable rows' losses (TRL's KTOConfig default 1.0; "
        "raise it when desirable rows are rarer, keeping desirable_weight × desirable rows "
        "over undesirable_weight × undesirable rows between 1 and 4/3, as the KTO paper says).",
    )
    undesirable_weight: float = Field(
        default=1.0, gt=0, description="kto: the weight of undesirable rows' losses (TRL: 1.0)."
    )

    def beta_for(self, objective: str) -> float:
        return self.beta if self.beta is not None else PREFERENCE_BETA[objective]


class TrainSection(_Section):
    objective: Objective = Field(
        default="sft",
        description="sft: next-token loss on the data's targets. dpo, ipo, hinge: preference "
        "losses against a reference (the base with the adapter off under lora/qlora, else "
        "log-probs precomputed before step 1); simpo, orpo: preference losses without a "
        "reference. Preference data are prompt/chosen/rejected rows (docs: preference). "
        "kto: unpaired feedback, prompt/completion/label rows, against a reference as dpo. "
        "grpo, rloo: online RL from rewards on completions sampled from prompt rows (docs: rl).",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection,
        description="Options of the preference objectives.",
    )
    rl: RLSection = Field(
        default_factory=RLSection,
        description="Options of the online RL objectives (grpo, rloo).",
    )
    micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="Sequences per worker per micro step (pairs, each two sequences, for a "
        "preference objective).",
    )
    grad_accum: int = Field(default=1, ge=1, description="Micro steps per optimizer step.")
    global_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Sequences per optimizer step over all workers. If set, grad_accum is "
        "derived from it and must divide evenly.",
    )
    epochs: float | None = Field(
        default=1, gt=0, description="Passes over the data (fractions ok)."
    )
    max_steps: int | None = Field(default=None, ge=1, description="Overrides epochs if set.")
    stop_at_step: int | None = Field(
        default=None,
        ge=1,
        description="End this submission after this step (the schedule still spans the "
        "whole run); resubmit with the same run name to continue.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="Compute dtype; bf16/fp16 autocast over fp32 master weights (GPU).",
    )
    seed: int = Field(default=42, description="Seeds init, data order and RNG streams.")
    eval_every: int | None = Field(default=None, ge=1, description="Steps between evals.")
    eval_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Blocks each eval reads: the first N of the eval set, the same blocks for "
        "any world size, layout, grad_accum or elastic size; null = the whole eval set.",
    )
    eval_batches: int | None = Field(
        default=None,
        ge=1,
        description="Older form of eval_blocks: eval_batches × micro_batch_size blocks for the "
        "whole run (it used to count per worker, so the eval set changed with the layout).",
    )

    eval_tasks: list[str] = Field(
        default_factory=list,
        description="Benchmarks scored in the loop with lm-evaluation-harness: task names "
        "(arc_easy, hellaswag, gsm8k...) or paths of local task YAMLs (their data a local "
        "jsonl, on a path every worker reads). Scores go to metrics as "
        "eval/<task>/<metric> (docs: evaluation).",
    )
    eval_tasks_every: int | None = Field(
        default=None,
        ge=1,
        description="Steps between benchmark runs; they also run before step 1 and at the "
        "last step. null = before step 1 and at the last step only.",
    )
    eval_tasks_limit: int | None = Field(
        default=None,
        ge=1,
        description="Examples per task (lm-eval's limit: the first N); null = the whole task.",
    )

    @property
    def eval_limit(self) -> int | None:
        """Blocks each eval reads: eval_blocks, else eval_batches × micro_batch_size."""
        if self.eval_blocks is not None:
            return self.eval_blocks
        if self.eval_batches is not None:
            return self.eval_batches * self.micro_batch_size
        return None

    log_every: int = Field(default=1, ge=1, description="Steps between metric reports.")
    as_test: bool = Field(
        default=False, description="One forward/backward and one step, then exit (smoke test)."
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (ddp, fsdp). Needs a C compiler on "
        "every node (inductor builds its kernels there); the first steps are slower while "
        "it compiles. Off by default: on CPU it did not pay (docs: strategies, benchmarks).",
    )
    loss: Literal["auto", "chunked", "liger", "plain"] = Field(
        default="auto",
        description="The causal-LM loss: chunked never holds a batch's whole logits (Raylift's "
        "torch version); liger = liger-kernel's fused linear cross-entropy (GPUs only); auto "
        "= liger on GPUs where it is installed, else chunked, for the families it was "
        "checked on (pp and tp included), plain (the model's own) otherwise (docs: strategies).",
    )
    loss_chunk: int = Field(default=1024, ge=1, description="Tokens per chunk of the chunked loss.")
