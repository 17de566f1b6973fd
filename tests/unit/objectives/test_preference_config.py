"""train.objective's defaults and its one-line refusals."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError


def _cfg(**train_and_more):
    data = {"train_file": "p.jsonl", **train_and_more.pop("data", {})}
    strategy = train_and_more.pop("strategy", {"name": "ddp"})
    return load_config(
        {
            "model": {"path": "m"},
            "data": data,
            "strategy": strategy,
            "train": {"max_steps": 1, **train_and_more},
            "scaling": {"num_workers": 4},
            "run": {"name": "pref"},
        }
    )


def test_defaults_are_sft_and_the_papers_betas():
    assert _cfg().train.objective == "sft" and _cfg().sequences_per_example == 1
    betas = {o: _cfg(objective=o).train.preference.beta_for(o) for o in ("dpo", "ipo", "simpo")}
    assert betas == {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}
    assert (
        _cfg(objective="orpo", preference={"beta": 0.25}).train.preference.beta_for("orpo") == 0.25
    )
    assert _cfg(objective="simpo").train.preference.simpo_gamma == 1.0
    assert _cfg(objective="dpo").sequences_per_example == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"strategy": {"name": "fsdp", "tp": 2}}, "train.objective: dpo with strategy.tp/pp > 1"),
        (
            {"strategy": {"name": "fsdp", "pp": 2}, "micro_batch_size": 2},
            "train.objective: dpo with strategy.tp/pp > 1",
        ),
        ({"data": {"eval_file": "e.jsonl"}}, "data.eval_file: not supported with train.objective"),
        ({"data": {"train_file": ["a.jsonl", "b.jsonl"]}}, "data.train_file: a list of sources"),
        ({"data": {"attention": "document"}}, "data.attention: document does not apply"),
    ],
)
def test_what_cannot_be_done_is_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(objective="dpo", **extra)
    assert "\n" not in str(err.value).strip()
