"""KTO against TRL 1.16 itself (test-only oracle): on one tiny Llama and one batch of
unpaired rows, the loss and every parameter's gradient match KTOTrainer._compute_loss to
1e-5 relative, with a precomputed reference (full fine-tuning) and with LoRA's adapter-off
reference; TRL's metrics by TRL's names; and KTO rows through the pair cache give TRL's
own prompt, completion and mismatched (KL) completion ids."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.support.small_model import tiny_llama
from trainer.config import load_config
from trainer.data.tokenize import IGNORE, Settings, prepare
from trainer.objectives import build_objective, losses
from trainer.objectives.kto import KTOBlocks
from trainer.objectives.pairs import data_options
from trainer.objectives.rows import parse_unpaired

BLOCK, VOCAB = 20, 64
ROWS = [  # (prompt length, completion length, desirable)
    (5, 7, True),
    (3, 9, False),
    (8, 2, True),
    (4, 5, False),
]


def _cfg(adapter: str = "none", block: int = BLOCK, train_file: str = "unused.jsonl", **pref):
    return load_config(
        {
            "model": {"path": "unused", "adapter": adapter},
            "data": {"train_file": train_file, "block_size": block},
            "train": {"objective": "kto", "max_steps": 1, "preference": pref},
            "scaling": {"num_workers": 1},
            "run": {"name": "kto"},
        }
    )


def _batch() -> dict[str, torch.Tensor]:
    """Rows and their mismatched sequences (prompt i, completion i-1), right-padded."""
    g = torch.Generator().manual_seed(11)
    n = len(ROWS)
    prompts = [torch.randint(1, VOCAB, (p,), generator=g) for p, _, _ in ROWS]
    completions = [torch.randint(1, VOCAB, (c,), generator=g) for _, c, _ in ROWS]
    out = {}
    for prefix, shift in (("", 0), ("KL_", 1)):
        ids = torch.zeros((n, BLOCK), dtype=torch.long)
        mask = torch.zeros((n, BLOCK), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            c = completions[(i - shift) % n]
            ids[i, : len(prompt)] = prompt
            ids[i, len(prompt) : len(prompt) + len(c)] = c
            mask[i, len(prompt) : len(prompt) + len(c)] = 1
        out[f"{prefix}input_ids"] = ids
        out[f"{prefix}attention_mask"] = torch.ones_like(ids)
        out[f"{prefix}completion_mask"] = mask
    out["label"] = torch.tensor([d for _, _, d in ROWS])
    return out


def _ours_layout(b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raylift's micro batch: the rows, then their mismatched sequences, as labels."""
    ids = torch.cat([b["input_ids"], b["KL_input_ids"]])
    mask = torch.cat([b["completion_mask"], b["KL_completion_mask"]])
    return ids, ids.masked_fill(mask == 0, IGNORE)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= rel * scale, (a, b)


def _stand_in(model, precompute: bool, **kw):
    """What KTOTrainer._compute_loss reads of its trainer, and nothing more."""
    from accelerate import Accelerator

    return SimpleNamespace(
        model=model,
        ref_model=None,
        accelerator=Accelerator(cpu=True),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        aux_loss_enabled=False,
        precompute_ref_logps=precompute,
        calculate_KL=True,
        loss_type="kto",
        beta=kw.get("beta", 0.1),
        desirable_weight=kw.get("desirable_weight", 1.0),
        undesirable_weight=kw.get("undesirable_weight", 1.0),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        _compute_kl_logps=None,
    )


def _trl(model, batch, precompute: bool, **kw):
    from trl import KTOTrainer

    trainer = _stand_in(model, precompute, **kw)
    trainer._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(trainer, m, b)
    model.zero_grad()
    loss = KTOTrainer._compute_loss(trainer, model, batch, False)
    loss.backward()
    return loss, _grads(model), trainer._metrics["train"]


def _ours(cfg, model, batch, ref=None):
    obj = build_objective(cfg)
    x, y = _ours_layout(batch)
    model.zero_grad()
    n = len(ROWS)
    loss = obj.loss(model, x, y, torch.tensor(float(n)), desirable=batch["label"], ref=ref)
    loss.backward()
    return loss, _grads(model), obj.metrics(lambda values: values)


def _compare(ours, theirs) -> None:
    _close(ours[0].detach(), theirs[0].detach())
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name in ours[1]:
        _close(ours[1][name], theirs[1][name])
    for name in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert ours[2][name] == pytest.approx(theirs[2][name][0], rel=1e-5, abs=1e-7), name
    assert ours[2]["rewards/margins"] == pytest.approx(
        theirs[2]["rewards/margins"][0], rel=1e-5, abs=1e-7
    )


@pytest.mark.parametrize(
    "weights", [{}, {"desirable_weight": 1.33, "undesirable_weight": 0.5, "beta": 0.3}]
)
def test_kto_matches_trl_with_a_precomputed_reference(weights) -> None:
    from trl.trainer.utils import add_fused_lm_head

    batch = _batch()
    x, y = _ours_layout(batch)
    with torch.no_grad():  # the reference: another model's log-probs, as precomputed
        ref = losses.sequence_logps(tiny_llama(1, VOCAB)(input_ids=x).logits, y)[0]
    model = tiny_llama(0, VOCAB)
    theirs_model = copy.deepcopy(model)
    add_fused_lm_head(theirs_model, outputs=("log_probs", "entropy", "mean_logits"))
    n = len(ROWS)
    trl_batch = dict(batch, ref_logps=ref[:n], ref_KL_logps=ref[n:])
    ours = _ours(_cfg(**weights), model, batch, ref)
    theirs = _trl(theirs_model, trl_batch, True, **weights)
    _compare(ours, theirs)
    assert theirs[2]["kl"][0] > 0  # the KL term is live in this batch, not clamped away


def test_kto_matches_trl_with_lora_adapter_off_reference() -> None:
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    batch = _batch()
    base = tiny_llama(0, VOCAB)
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits"))
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(5)
    model = get_peft_model(base, lora)
    model.train()
    theirs = _trl(model, batch, False)
    ours = _ours(_cfg(adapter="lora"), model, batch)
    _compare(ours, theirs)


def test_micro_batches_and_kl_add_up() -> None:
    """Each micro batch's loss is its rows' sum over the step's count; split in two, the
    losses add up to TRL's per-micro-batch means averaged (its accumulation)."""
    batch = _batch()
    x, y = _ours_layout(batch)
    with torch.no_grad():
        ref = losses.sequence_logps(tiny_llama(1, VOCAB)(input_ids=x).logits, y)[0]
    model = tiny_llama(0, VOCAB)
    obj = build_objective(_cfg())
    n, total = len(ROWS), torch.tensor(float(len(ROWS)))
    got = 0.0
    for part in ([0, 1], [2, 3]):
        rows = torch.tensor(part + [n + i for i in part])
        got += float(
            obj.loss(model, x[rows], y[rows], total, desirable=batch["label"][part], ref=ref[rows])
        )
    from trl.trainer.utils import add_fused_lm_head

    theirs_model = copy.deepcopy(model)
    add_fused_lm_head(theirs_model, outputs=("log_probs", "entropy", "mean_logits"))
    want = 0.0
    for part in ([0, 1], [2, 3]):
        sub = {k: v[part] for k, v in batch.items()}
        sub.update(ref_logps=ref[part], ref_KL_logps=ref[[n + i for i in part]])
        want += float(_trl(theirs_model, sub, True)[0]) / 2
    assert got == pytest.approx(want, rel=1e-5)


def test_kto_rows_through_the_cache_match_trl(tiny, tmp_path: Path) -> None:
    """Prompt, completion and KL completion ids as TRL's KTOTrainer prepares them (one
    sequential batch holding every row: its rotation is then the previous row's)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOTrainer

    rows = [
        {"prompt": "What is 2 plus 2?", "completion": " It is 4.", "label": True},
        {"prompt": "Name a colour.", "completion": " Blue.", "label": True},
        {"prompt": "What is 3 plus 3?", "completion": " Maybe 7.", "label": False},
    ]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(str(tiny["model"]))
    cfg = _cfg(block=64, train_file=str(path))
    opts = data_options(cfg, Settings(block_size=64))
    cache = prepare(str(path), tok, cache_root=str(tmp_path / "c"), progress=False, **opts)
    blocks = KTOBlocks(cache, 64)
    assert blocks.desirable.tolist() == [True, True, False]
    ids, labels, _ = blocks.gather(np.arange(3))

    stand_in = SimpleNamespace(_tokenizer=tok, calculate_KL=True)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=3)
    done = KTOTrainer._prepare_dataset(stand_in, Dataset.from_list(rows), tok, args, "eval")
    for i, want in enumerate(done):
        for row, key in ((i, "completion_ids"), (3 + i, "KL_completion_ids")):
            start = int(np.argmax(labels[row] != IGNORE))
            assert ids[row, :start].tolist() == want["prompt_ids"]
            assert ids[row][labels[row] != IGNORE].tolist() == want[key]


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "q", "completion": "a"}, "missing field 'label'"),
        ({"prompt": "q", "completion": "a", "label": 1}, '"label" must be true or false'),
        (
            {"prompt": "q", "completion": [{"role": "assistant", "content": "a"}], "label": True},
            "both",
        ),
        ({"prompt": "q", "chosen": "a", "rejected": "b"}, "train.objective: dpo"),
        ({"prompt": "q", "completion": "  ", "label": False}, '"completion" is empty'),
    ],
)
def test_bad_kto_rows(row, problem) -> None:
    got, why = parse_unpaired(row)
    assert got is None and problem in why


def test_preflight_reads_kto_rows_with_columns(tmp_path: Path) -> None:
    """The laptop's check reads KTO rows (through data.columns) and names file:line."""
    from trainer.errors import DataError
    from trainer.preflight import Report, check_data_file

    path = tmp_path / "feedback.jsonl"
    good = {"question": "q", "answer": "a", "thumbs_up": True}
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, thumbs_up="yes")) + "\n")
    columns = {"prompt": "question", "completion": "answer", "label": "thumbs_up"}
    with pytest.raises(DataError, match=r'feedback.jsonl:2: "label" must be true or false'):
        check_data_file(str(path), "data.train_file", True, "error", Report(), "kto", columns)
    path.write_text(json.dumps(good) + "\n")
    check_data_file(str(path), "data.train_file", True, "error", Report(), "kto", columns)


def test_plan_names_kto_rows_and_its_reference(tmp_path: Path) -> None:
    from tests.support.jobs import llama7b_job
    from trainer.planner.memory import Setup
    from trainer.planner.preference import cost, notes

    cfg = load_config(
        llama7b_job(
            tmp_path,
            model={"path": str(tmp_path / "model"), "adapter": "lora"},
            strategy={"name": "ddp"},
            train={"precision": "bf16", "objective": "kto", "micro_batch_size": 2},
            scaling={"num_workers": 4, "use_gpu": True},
        )
    )
    c = cost(cfg, 6_738_415_616, Setup.from_config(cfg), None, None)
    assert c is not None and c.reference == "adapter_off"
    assert "kto: 8 rows per step = 16 sequences" in notes(c)[0]
