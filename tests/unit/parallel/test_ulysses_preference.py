"""Preference objectives under sequence parallelism are exact: on 4 spawned gloo ranks (no
Ray), through the real strategies and the real objectives, each rank holding a share of
every chosen and rejected row, the step's reported loss and every gradient match one
process running the whole global batch within 1e-5: sp 4 (one replica) and sp 2 (dp 2 ×
sp 2); DPO full (the reference a column of the batch) and LoRA (the reference the model
with its adapter off, itself sharded), under DDP and FSDP2; IPO, hinge, SimPO and ORPO,
whose losses read the rows' target counts too; and the column of full fine-tuning's
reference pass, computed from the shares, equals one process's summed log-probs. The rows'
targets start and end inside different shares (one share of a row has none). One spawn
runs every case."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import sp_exact

BLOCK = 16
PAIRS = 2  # pairs in a replica's micro batch

CASES = [  # (name, strategy, sp, adapter, attention, model, objective)
    ("dpo_ddp_sp4", "ddp", 4, "none", "sdpa", "kv4", "dpo"),
    ("dpo_fsdp_sp2", "fsdp", 2, "none", "sdpa", "kv2", "dpo"),
    ("dpo_lora_fsdp_sp4", "fsdp", 4, "lora", "sdpa", "kv4", "dpo"),
    ("dpo_lora_ddp_sp2", "ddp", 2, "lora", "eager", "kv2", "dpo"),
    ("ipo_fsdp_sp2", "fsdp", 2, "none", "sdpa", "kv2", "ipo"),
    ("hinge_ddp_sp4", "ddp", 4, "none", "eager", "kv4", "hinge"),
    ("simpo_fsdp_sp4", "fsdp", 4, "none", "sdpa", "kv4", "simpo"),
    ("orpo_lora_fsdp_sp2", "fsdp", 2, "lora", "sdpa", "kv2", "orpo"),
]
WORLD = 4


def _pairs(replicas: int) -> list[tuple[np.ndarray, ...]]:
    """Each replica's micro batch of PAIRS pairs as the pair cache gives it: (ids, labels,
    reference column), chosen rows first. A pair's rows share a prompt; completions end
    at different places, then padding (not a target)."""
    gen = np.random.default_rng(11)
    shapes = [(3, 14, 7), (9, 16, 12), (5, 6, 15), (2, 11, 16)]  # prompt, chosen/rejected end
    out = []
    for r in range(replicas):
        ids = gen.integers(0, sp_exact.VOCAB, (2 * PAIRS, BLOCK), dtype=np.int64)
        labels = np.full_like(ids, -100)
        for p in range(PAIRS):
            prompt, c_end, r_end = shapes[(r * PAIRS + p) % len(shapes)]
            ids[PAIRS + p, :prompt] = ids[p, :prompt]
            labels[p, prompt:c_end] = ids[p, prompt:c_end]
            labels[PAIRS + p, prompt:r_end] = ids[PAIRS + p, prompt:r_end]
        # about a uniform guess's log-probs: rewards of a few nats, losses of a few units
        targets = (labels[:, 1:] != -100).sum(1)
        ref = -np.log(sp_exact.VOCAB) * targets + gen.normal(0.0, 1.0, 2 * PAIRS)
        out.append((ids, labels, ref))
    return out


def _whole(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """The replicas' micro batches as one batch, every chosen row first."""
    cols = []
    for k in range(3):
        chosen = [p[k][:PAIRS] for p in parts]
        rejected = [p[k][PAIRS:] for p in parts]
        cols.append(np.concatenate(chosen + rejected))
    return tuple(cols)


def _set_lora_b(model: torch.nn.Module) -> None:
    """LoRA's B starts at 0 (the adapter a no-op, the reference equal to the policy): a
    constant makes the adapter count, the same on one process and on every shard."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)


def _ranks(rank: int, world: int, store: str, root: str) -> None:
    sp_exact.init_gloo(rank, world, store)
    out = {}
    for name, strategy, sp, adapter, attention, model, objective in CASES:
        model_dir = f"{root}/{model}"
        cfg = sp_exact.job_config(
            model_dir, strategy, sp, adapter, attention, world, BLOCK, PAIRS, objective
        )
        s = sp_exact.build(cfg, model_dir, rank, world)
        _set_lora_b(s.model)
        replica, replicas = cfg.data_rank(rank, world)
        mine = _pairs(replicas)[replica]
        out[name] = sp_exact.train_micro(s, mine, lambda segs: {}, world)
        assert out[name]["shape"] == [2 * PAIRS, BLOCK // sp], name
        if adapter == "none" and objective in ("dpo", "ipo", "hinge"):
            # the reference pass before step 1 (trainer.objectives.reference): sharded too
            ids, labels, _ = (torch.from_numpy(a) for a in mine)
            with s.evaluating():
                out[name]["column"] = s.objective.row_logps(s, ids, labels).tolist()
        del s
    sp_exact.write(root, world, rank, out)


def _reference(root: Path, case: tuple) -> tuple[float, dict[str, torch.Tensor], list]:
    """One process, the whole global batch: the mean pair loss, every gradient, and each
    replica's rows' summed log-probs (what the reference pass stores)."""
    from transformers import AutoModelForCausalLM

    from trainer.model import adapters
    from trainer.objectives.losses import sequence_logps
    from trainer.objectives.preference import Preference

    _name, strategy, sp, adapter, attention, model, objective = case
    cfg = sp_exact.job_config(
        str(root / model), strategy, 1, adapter, attention, WORLD, BLOCK, PAIRS, objective
    )
    one = AutoModelForCausalLM.from_pretrained(
        str(root / model), dtype=torch.float32, attn_implementation=attention
    )
    if adapter != "none":
        one = adapters.apply(one, cfg, False)
        _set_lora_b(one)
    one.train()
    with torch.no_grad():
        columns = [
            sequence_logps(one(input_ids=torch.from_numpy(i)).logits, torch.from_numpy(t))[0]
            for i, t, _ in _pairs(WORLD // sp)
        ]
    ids, labels, ref = _whole(_pairs(WORLD // sp))
    pref = Preference(cfg)
    kw = {"ref": torch.from_numpy(ref)} if pref.column_reference else {}
    loss = pref.loss(one, torch.from_numpy(ids), torch.from_numpy(labels), len(ids) // 2, **kw)
    loss.backward()
    grads = {n: p.grad for n, p in one.named_parameters() if p.requires_grad}
    return loss.item(), grads, columns


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return sp_exact.save_models(tmp_path_factory.mktemp("sp-pref"))


def test_preference_under_sequence_parallelism_matches_one_process(models: Path) -> None:
    sp_exact.spawn(_ranks, WORLD, str(models / "store"), str(models))
    outs = sp_exact.read(models, WORLD)
    columns = 0
    for name, _strategy, sp, *_rest in CASES:
        want_loss, want_grads, want_columns = _reference(models, (name, _strategy, sp, *_rest))
        sp_exact.assert_matches(outs, name, sp == WORLD, want_loss, want_grads)
        for rank, o in enumerate(outs):
            if "column" in o[name]:
                diff = (torch.tensor(o[name]["column"]) - want_columns[rank // sp]).abs().max()
                assert diff < 1e-5, (name, rank, float(diff))
                columns += 1
    assert columns == 4 * WORLD  # dpo ddp, dpo fsdp, ipo, hinge: every rank
