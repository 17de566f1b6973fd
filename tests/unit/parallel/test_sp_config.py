"""`strategy.sp`'s refusals, each one line before any worker starts: the config's (workers,
block, tp/pp, elastic, objectives) and preflight's from the model's config.json
(KV heads, attention heads, mixture of experts). Pure Python: no torch."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.parallel.layout import check_model_layout


def _job(strategy: dict, workers: object = 4, **sections: dict) -> dict:
    job = {
        "model": {"path": "m"},
        "data": {"train_file": "x.jsonl", "block_size": 16},
        "train": {"micro_batch_size": 1, "max_steps": 2},
        "strategy": strategy,
        "scaling": {"num_workers": workers},
        "run": {"name": "sp"},
    }
    for k, v in sections.items():
        job[k] = {**job[k], **v}
    return job


def _refusal(job: dict) -> str:
    with pytest.raises(Exception) as e:
        load_config(job)
    (line,) = str(e.value).strip().splitlines()[:1]
    return line


def test_sp_shares_the_batch_between_its_workers():
    cfg = load_config(_job({"name": "fsdp", "sp": 2}))
    assert (cfg.model_parallel, cfg.data_parallel, cfg.global_batch) == (2, 2, 2)
    assert [cfg.data_rank(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert load_config(_job({"name": "ddp", "sp": 4})).data_parallel == 1
    assert load_config(_job({"name": "deepspeed", "sp": 2})).data_parallel == 2  # ZeRO-3
    for objective in ("dpo", "ipo", "hinge", "simpo", "orpo"):  # exact: test_ulysses_preference
        cfg = load_config(_job({"name": "fsdp", "sp": 2}, train={"objective": objective}))
        assert (cfg.strategy.sp, cfg.data_parallel) == (2, 2)


@pytest.mark.parametrize(
    "job,expected",
    [
        (_job({"name": "fsdp", "sp": 3}), "strategy.sp: 3 does not divide scaling.num_workers 4"),
        (_job({"name": "ddp", "sp": 2}, data={"block_size": 15}), "data.block_size: 15"),
        (_job({"name": "fsdp", "sp": 2, "tp": 2}), "strategy.sp: 2 with strategy.tp/pp > 1"),
        (_job({"name": "fsdp", "sp": 2}, [2, 4]), "(elastic) needs strategy.sp = 1"),
        (
            _job({"name": "fsdp", "sp": 2}, train={"objective": "kto"}),
            "train.objective: kto with strategy.sp > 1 is not in this build (sequence "
            "parallelism is exact for sft, dpo, ipo, hinge, simpo, orpo)",
        ),
    ],
)
def test_what_sp_cannot_do_is_one_line(job: dict, expected: str) -> None:
    assert expected in _refusal(job)


def test_preflight_refuses_sp_that_does_not_divide_the_heads_or_a_router():
    strategy = load_config(_job({"name": "fsdp", "sp": 4})).strategy
    llama8b = {"num_attention_heads": 32, "num_key_value_heads": 8}
    check_model_layout(strategy, llama8b, "m/config.json")  # 4 divides 8 and 32
    with pytest.raises(ConfigError) as e:
        check_model_layout(strategy, {**llama8b, "num_key_value_heads": 2}, "m/config.json")
    assert str(e.value) == (
        "strategy.sp: 4 does not divide the model's num_key_value_heads 2 (m/config.json); "
        "use a divisor of 2"
    )
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check_model_layout(strategy, {**llama8b, "num_experts": 8}, "m/config.json")
