"""The rollout feed on a real (one-worker DDP) strategy and the tiny model: prompt rows
read through the project's sources, completions sampled by `generate`, scored, turned into
group advantages and laid out as the loss's micro batches; the same completions again for
a resumed step; a training step through the strategy with TRL's metric names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import load_config
from trainer.rollouts.prompts import prepare_prompts
from trainer.strategies.base import ModelSource, build_strategy

EOS = 1


class _Run:
    """The run folder a worker writes completions.jsonl to (trainer.runtime's, locally)."""

    def __init__(self, root: Path):
        import pyarrow.fs as pafs

        self.root, self.fs = root, pafs.LocalFileSystem()

    def join(self, name: str):
        from types import SimpleNamespace

        return SimpleNamespace(fs=self.fs, path=str(self.root / name))


def _job(tiny, tmp_path: Path, objective: str = "grpo", adapter: str = "none", **rl):
    rows = [{"question": f"what is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        {
            "model": {"path": str(tiny["model"]), "adapter": adapter},
            "data": {"train_file": str(data), "columns": {"prompt": "question"}},
            "train": {
                "objective": objective,
                "micro_batch_size": 4,
                "grad_accum": 2,
                "max_steps": 2,
                "rl": {
                    "num_generations": 4,
                    "max_completion_length": 8,
                    "rewards": [
                        {"function": "length_target", "options": {"target": 4}},
                        {"function": "math_answer", "weight": 0.5},
                        {"function": "format_regex", "options": {"pattern": "e"}},
                    ],
                    "log_completions_every": 1,
                    **rl,
                },
            },
            "scaling": {"num_workers": 1},
            "storage": {"path": str(tmp_path / "runs")},
            "run": {"name": "rl"},
        }
    )


def _feed(cfg, tiny, tmp_path: Path):
    strategy = build_strategy(cfg, torch.device("cpu"), 0, 1)
    strategy.setup(ModelSource(tiny["model"], 0))
    strategy.model.train()
    objective = strategy.objective  # the loss the strategy runs, as in the loop
    feed = objective.open_feed(prepare_prompts(cfg), [], 0, 1)
    rt = type("Rt", (), {"rank": 0, "run": _Run(tmp_path)})()
    objective.before_training(strategy, feed, rt)
    return strategy, objective, feed


@pytest.fixture
def setup(tiny, tmp_path):
    cfg = _job(tiny, tmp_path)
    return cfg, *_feed(cfg, tiny, tmp_path)


def test_a_rollout_is_the_losss_micro_batches(setup) -> None:
    _, _, _, feed = setup
    assert feed.steps_per_epoch == 3  # 6 prompts, 2 a step
    micro = feed.micro_batches(0)
    assert len(micro) == 2 and all(len(m) == 6 for m in micro)
    ids, attention, mask, adv, old, ref = (np.concatenate(a) for a in zip(*micro, strict=True))
    assert ids.shape == attention.shape and mask.shape[1] <= 8 and len(ids) == 8
    assert old.shape[1] == ref.shape[1] == 0  # num_iterations 1, beta 0: neither is needed
    lengths = mask.sum(1)
    assert (lengths >= 1).all() and (lengths <= 8).all()
    # the completion tokens end at EOS or at max_completion_length
    width = mask.shape[1]
    for row, n in zip(ids, lengths, strict=True):
        assert row[-width:][n - 1] == EOS or n == 8
    # rewards → advantages: each group of 4 sums to ~0 (group-relative)
    assert np.allclose(adv.reshape(2, 4).sum(1), 0.0, atol=1e-4)
    (stats,) = feed.stats
    expected = np.maximum(0.0, 1 - np.abs(lengths - 4) / 4)  # length_target; math_answer 0
    assert stats.per_function[0] == pytest.approx(expected.sum(), abs=1e-9)


def test_a_resumed_step_samples_the_same_completions(setup, tiny, tmp_path) -> None:
    cfg, _, _, feed = setup
    first = feed.micro_batches(1)
    _, _, again = _feed(cfg, tiny, tmp_path)
    torch.manual_seed(1234)  # a resumed worker's RNG is wherever its restart left it
    for a, b in zip(first, again.micro_batches(1), strict=True):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
    state = torch.get_rng_state()
    other = feed.micro_batches(0)
    assert torch.equal(state, torch.get_rng_state())  # training's RNG streams untouched
    assert not all(
        np.array_equal(a[0], b[0]) for a, b in zip(first, other, strict=True)
    )  # another step, other prompts and samples


def test_num_iterations_reuses_the_rollout_with_its_logps(tiny, tmp_path) -> None:
    cfg = _job(tiny, tmp_path, num_iterations=2, beta=0.04)
    _, _, feed = _feed(cfg, tiny, tmp_path)
    assert feed.steps_per_epoch == 6
    a, b = feed.micro_batches(0), feed.micro_batches(1)
    assert a is b and len(feed.stats) == 1
    _, _, _, _, old, ref = a[0]
    assert old.shape == ref.shape == a[0][2].shape
    assert np.allclose(old, ref, atol=1e-5)  # before any update the policy is the reference


def _train_step(strategy, objective, micro) -> float:
    total = sum(objective.count(m) for m in micro)
    for i, m in enumerate(micro):
        x, y, kw = objective.inputs(m, torch.device("cpu"))
        with strategy.accumulating(i == len(micro) - 1):
            strategy.train_micro(x, y, torch.tensor(float(total)), **kw)
    return strategy.step()


@pytest.mark.parametrize(("objective", "adapter"), [("rloo", "none"), ("grpo", "lora")])
def test_the_reference_starts_as_the_policy(tiny, tmp_path, objective, adapter) -> None:
    """rloo (its default beta 0.05, a frozen copy) and grpo under LoRA (the adapter off):
    before any update the reference's log-probs are the policy's, so kl is 0; after one,
    the reference has not moved with the policy."""
    beta = {} if objective == "rloo" else {"beta": 0.04}
    cfg = _job(tiny, tmp_path, objective, adapter, **beta)
    strategy, obj, feed = _feed(cfg, tiny, tmp_path)
    micro = feed.micro_batches(0)
    _, _, mask, _, old, ref = micro[0]
    assert ref.shape == mask.shape
    if objective == "rloo":
        assert old.shape == (4, 1)  # summed per completion: its ratio is per sequence
    assert _train_step(strategy, obj, micro) > 0
    metrics = obj.metrics(lambda values: values)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-5)
    _train_step(strategy, obj, feed.micro_batches(1))  # sampled by the updated policy
    assert obj.metrics(lambda values: values)["kl"] > 1e-6  # the reference stayed behind


def test_a_training_step_and_its_metrics(setup, tmp_path) -> None:
    _, strategy, objective, feed = setup
    assert _train_step(strategy, objective, feed.micro_batches(0)) > 0
    metrics = objective.metrics(lambda values: values)
    for name in (
        "reward",
        "reward_std",
        "rewards/length_target/mean",
        "rewards/math_answer/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio/region_mean",
        "rollout/generate_s",
        "rollout/tokens_per_s",
    ):
        assert name in metrics, name
    assert 0 < metrics["completions/mean_length"] <= 8
    assert metrics["clip_ratio/region_mean"] == 0.0  # the first pass: every ratio is 1
    logged = [
        json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()
    ]
    assert logged and {"step", "prompt", "completion", "reward", "rewards"} <= set(logged[0])
    assert logged[0]["prompt"].startswith("what is")
