"""train.eval_tasks before launch, the split of requests over ranks, and the metric names."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.evaluation.sharded import in_request_order, share
from trainer.evaluation.specs import check, resolve
from trainer.evaluation.tasks import scores


def _job(**train) -> dict:
    return {
        "model": {"path": "m"},
        "data": {"train_file": "x.jsonl"},
        "train": train,
        "run": {"name": "t"},
    }


def test_a_local_task_yaml_is_named_by_its_task_line(tmp_path):
    yaml = tmp_path / "tasks" / "mine.yaml"
    yaml.parent.mkdir()
    yaml.write_text("# my task\ntask: my_task  # the name\ndataset_path: json\n")
    cfg = load_config(_job(eval_tasks=[str(yaml), "arc_easy"], eval_tasks_every=5))
    assert cfg.train.eval_tasks_every == 5 and cfg.train.eval_tasks_limit is None
    assert resolve(cfg.train.eval_tasks) == (["my_task", "arc_easy"], [str(yaml.parent)])


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("/nowhere/task.yaml", "task YAML /nowhere/task.yaml does not exist"),
        ("no good!", "'no good!' is not a task name"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_field(spec, says):
    with pytest.raises(ValueError) as e:
        check([spec], strict=True)
    msg = str(e.value)
    assert msg.startswith("train.eval_tasks: ") and says in msg and "\n" not in msg


def test_a_yaml_missing_on_a_laptop_is_a_note_for_the_cluster(tmp_path):
    yaml = str(tmp_path / "shared" / "t.yaml")
    assert check([yaml], strict=False) == [
        f"train.eval_tasks: {yaml}: not on this machine; checked on the cluster"
    ]


def test_a_yaml_without_a_task_line_is_refused_even_on_a_laptop(tmp_path):
    yaml = tmp_path / "t.yaml"
    yaml.write_text("dataset_path: json\n")
    with pytest.raises(ValueError, match="has no 'task:' line"):
        check([str(yaml)], strict=False)


def test_preflight_refuses_an_unknown_task_name_in_one_line(tmp_path):
    from trainer.preflight import Report, check_eval_tasks

    cfg = load_config(_job(eval_tasks=["arc_easy", "arc_eassy"]))
    with pytest.raises(ConfigError, match="unknown lm-eval task arc_eassy;"):
        check_eval_tasks(cfg, True, Report())


@pytest.mark.parametrize("n", [1, 2, 5, 7, 8])
def test_every_rank_gets_as_many_requests_and_the_gather_restores_their_order(n):
    items = [f"r{i}" for i in range(n)]
    world = 3
    shares = [share(items, rank, world) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1  # as many forward passes on every rank
    results = [[f"{x}!" for x in s] for s in shares]  # each rank's results, its own order
    assert in_request_order(results, n) == [f"{x}!" for x in items]


def test_scores_are_named_per_task_and_metric_without_stderr():
    results = {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": "N/A"},
            "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1},
        }
    }
    assert scores(results) == {
        "eval/arc_easy/acc": 0.5,
        "eval/gsm8k/exact_match/strict-match": 0.25,
    }


def test_lm_evals_seeding_leaves_the_runs_rng_streams_where_they_were():
    import random

    import numpy as np
    import torch

    from trainer.evaluation.tasks import rng_kept

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    def seeded_run(evaluate: bool) -> tuple:
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        draws()
        if evaluate:
            with rng_kept():
                random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)  # lm-eval's
                draws()
        return draws()

    assert seeded_run(evaluate=True) == seeded_run(evaluate=False)
