"""(dp, pp, tp) layouts: every refusal is one line naming the field, raised before launch
(the config alone, or the preflight's read of the model's config.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.parallel.layout import check_model_layout

BASE = {
    "model": {"path": "/models/llama"},
    "data": {"train_file": "/data/train.jsonl", "block_size": 128},
    "train": {"micro_batch_size": 4, "grad_accum": 2, "max_steps": 10},
    "scaling": {"num_workers": 8},
    "run": {"name": "par"},
}
LLAMA = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "tie_word_embeddings": False,
}


def cfg(**strategy) -> JobConfig:
    data = copy.deepcopy(BASE)
    data["strategy"] = {"name": "fsdp", **strategy}
    return JobConfig.model_validate(data)


def refused(match: str, **strategy) -> str:
    with pytest.raises(ValueError, match=match) as exc:
        cfg(**strategy)
    msg = str(exc.value)
    return msg


def test_layout_divides_workers_and_keeps_the_global_batch_per_replica():
    c = cfg(tp=2, pp=2)
    assert (c.model_parallel, c.data_parallel) == (4, 2)
    assert c.global_batch == 4 * 2 * 2  # micro × accum × replicas, not × workers
    assert c.grad_accum_for(8) == 2
    # Ranks are (dp, pp, tp) row-major: a model-parallel group is 4 consecutive ranks.
    assert [c.data_rank(r, 8) for r in (0, 3, 4, 7)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert cfg().data_parallel == 8 and cfg().data_rank(5, 8) == (5, 8)


def test_workers_not_a_multiple_of_tp_x_pp():
    refused(r"scaling.num_workers: 8 workers do not divide into groups of tp × pp = 3 × 1", tp=3)


def test_microbatches_must_divide_micro_batch():
    refused(
        r"strategy.microbatches: 3 does not divide train.micro_batch_size 4", pp=2, microbatches=3
    )


def test_interleaved_needs_a_multiple_of_pp():
    refused(
        r"strategy.microbatches: interleaved_1f1b needs a multiple of pp = 4, got 2",
        pp=4,
        pp_schedule="interleaved_1f1b",
        microbatches=2,
    )


def test_fewer_microbatches_than_stages():
    refused(r"strategy.microbatches: 2 is fewer than pp = 4", pp=4, microbatches=2)


def test_pipeline_options_without_pp():
    refused(r"only meaningful with strategy.pp > 1", tp=2, microbatches=2)
    refused(r"only meaningful with strategy.pp > 1", pp_schedule="gpipe")


def test_elastic_and_offload_refused_with_model_parallel():
    data = copy.deepcopy(BASE)
    data["strategy"] = {"name": "fsdp", "tp": 2}
    data["scaling"] = {"num_workers": [4, 8]}
    with pytest.raises(ValueError, match=r"scaling.num_workers: \[min, max\] \(elastic\)"):
        JobConfig.model_validate(data)
    data["scaling"] = {"num_workers": 8, "use_gpu": True}
    data["strategy"]["cpu_offload"] = True
    with pytest.raises(ValueError, match=r"strategy.cpu_offload: not supported with tp or pp"):
        JobConfig.model_validate(data)


@pytest.mark.parametrize(
    ("change", "strategy", "match"),
    [
        (
            {"num_attention_heads": 30},
            {"tp": 4},
            r"strategy.tp: 4 does not divide the model's num_attention_heads 30",
        ),
        (
            {"num_key_value_heads": 2},
            {"tp": 4},
            r"strategy.tp: 4 does not divide the model's num_key_value_heads 2",
        ),
        (
            {"num_hidden_layers": 30},
            {"pp": 4},
            r"strategy.pp: the model's 30 layers do not split into 4 equal stages",
        ),
        (
            {"num_hidden_layers": 36},
            {"pp": 4, "pp_schedule": "interleaved_1f1b"},
            r"do not split into 8 equal stages \(pp 4 × 2 per worker",
        ),
        (
            {"tie_word_embeddings": True},
            {"pp": 2},
            r"strategy.pp: the model ties its input and output embeddings",
        ),
    ],
)
def test_model_refusals_name_the_model_file(change, strategy, match):
    mcfg = {**LLAMA, **change}
    with pytest.raises(ConfigError, match=match) as exc:
        check_model_layout(cfg(**strategy).strategy, mcfg, "/models/llama/config.json")
    assert "\n" not in str(exc.value) and "/models/llama/config.json" in str(exc.value)


def test_a_good_layout_passes_and_preflight_runs_the_model_checks(tmp_path: Path):
    check_model_layout(cfg(tp=2, pp=2).strategy, LLAMA, "x")
    check_model_layout(cfg(pp=4, pp_schedule="zbv", microbatches=4).strategy, LLAMA, "x")
    from trainer.preflight import Report, check_model

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 1}))
    (tmp_path / "tokenizer.json").write_text("{}")
    c = cfg(tp=2)
    c.model.path = str(tmp_path)
    with pytest.raises(ConfigError, match="num_key_value_heads 1"):
        check_model(c, True, Report())
