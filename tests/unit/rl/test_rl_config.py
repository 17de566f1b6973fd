"""train.objective grpo/rloo and train.rl: TRL's defaults, and what a job cannot combine
with online RL, each refused in one line before anything starts."""

from __future__ import annotations

from typing import Any

import pytest
from trl import GRPOConfig, RLOOConfig

from trainer.config import ConfigError, load_config

REWARD = [{"function": "math_answer"}]


def _cfg(train: dict[str, Any] | None = None, workers: int = 2, **top: Any):
    raw: dict[str, Any] = {
        "model": {"path": "unused"},
        "data": {"train_file": "prompts.jsonl", "block_size": 64},
        "train": {
            "objective": "grpo",
            "micro_batch_size": 4,
            "grad_accum": 2,
            "max_steps": 1,
            "rl": {"rewards": REWARD},
            **(train or {}),
        },
        "scaling": {"num_workers": workers},
        "run": {"name": "rl"},
        **top,
    }
    return load_config(raw)


def test_defaults_are_trls(tmp_path) -> None:
    rl = _cfg().train.rl
    trl = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    for name in (
        "num_generations",
        "loss_type",
        "beta",
        "epsilon",
        "epsilon_high",
        "scale_rewards",
        "num_iterations",
        "temperature",
        "top_p",
        "max_completion_length",
        "mask_truncated_completions",
    ):
        ours = rl.beta_for("grpo") if name == "beta" else getattr(rl, name)
        assert ours == getattr(trl, name), name
    rloo = RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    assert rl.beta_for("rloo") == rloo.beta
    assert rl.normalize_advantages == rloo.normalize_advantages
    assert rl.clip_high == rl.epsilon == 0.2


def test_rewards_name_a_file_function_or_a_builtin() -> None:
    rl = _cfg(
        {
            "rl": {
                "rewards": [
                    {"function": "r/my.py:score", "weight": 0.5},
                    {"function": "format_regex", "options": {"pattern": "x"}},
                ]
            }
        }
    ).train.rl
    assert [r.name for r in rl.rewards] == ["score", "format_regex"]
    assert rl.rewards[0].location == ("r/my.py", "score") and rl.rewards[1].location is None
    with pytest.raises(ConfigError, match=r"neither path/to/file\.py:function_name"):
        _cfg({"rl": {"rewards": [{"function": "my_reward"}]}})


@pytest.mark.parametrize(
    ("train", "top", "message"),
    [
        ({"rl": {}}, {}, "train.rl.rewards: train.objective grpo needs at least one reward"),
        (
            {"rl": {"rewards": REWARD, "num_generations": 3}},
            {},
            r"16 completions per step is not a multiple of train.rl.num_generations × "
            r"data-parallel replicas = 3 × 2 = 6",
        ),
        (
            {"objective": "rloo", "rl": {"rewards": REWARD, "loss_type": "grpo"}},
            {},
            "train.rl.loss_type: grpo does not apply to rloo",
        ),
        (
            {},
            {"strategy": {"name": "fsdp", "tp": 2}},
            "train.objective: grpo with strategy.tp/pp > 1 is not supported",
        ),
    ],
)
def test_refused_in_one_line(train, top, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        _cfg(train, **top)
    assert "\n" not in str(e.value).strip()


def test_sharded_strategies() -> None:
    """fsdp and ZeRO-3 sample with their weights sharded (synced decoding) and take a
    full fine-tuning reference (a frozen sharded copy); tp/pp stay refused."""
    beta = {"rl": {"rewards": REWARD, "beta": 0.04}}
    for strategy in (
        {"name": "fsdp"},
        {"name": "deepspeed"},
        {"name": "deepspeed", "config": "zero2"},
    ):
        assert _cfg(beta, strategy=strategy).train.rl.beta == 0.04
        lora = _cfg(beta, strategy=strategy, model={"path": "unused", "adapter": "lora"})
        assert lora.model.adapter == "lora"
    with pytest.raises(ConfigError, match=r"strategy\.tp/pp > 1 is not supported"):
        _cfg(strategy={"name": "fsdp", "tp": 2}, scaling={"num_workers": 2})


def test_elastic_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"\(elastic\) is not supported with train\.objective grpo"
    ):
        _cfg(scaling={"num_workers": [1, 2]})


def test_document_packing_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"data\.attention: document does not apply to train\.objective rloo"
    ):
        load_config(
            {
                "model": {"path": "unused"},
                "data": {"train_file": "p.jsonl", "attention": "document"},
                "train": {"objective": "rloo", "micro_batch_size": 8, "rl": {"rewards": REWARD}},
                "scaling": {"num_workers": 1},
                "run": {"name": "rl"},
            }
        )


def test_one_completion_is_one_sequence() -> None:
    cfg = _cfg()
    assert cfg.sequences_per_example == 1 and cfg.global_batch == 16
