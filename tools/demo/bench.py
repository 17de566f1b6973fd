"""The demo's benchmark: a local multiple-choice task over the demo's own kind of rows.

Each question comes in the training data's format (`<START_Q>q<END_Q><START_A>`); the
choices are its answer and two answers of other questions. The numbers of the right one
are in the question, so a model that learnt the format scores above chance (1/3) after
training, and a random one does not before it. The task is a local lm-eval YAML over a
jsonl file, as a team would write its own (docs/evaluation.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools.tiny import qa_pair

TASK = "demo_qa"


def write_task(out: Path, rows: int = 24, seed: int = 11) -> Path:
    """The task's jsonl and YAML under `out`; the YAML's path."""
    rng = random.Random(seed)
    pairs = [qa_pair(rng) for _ in range(rows + 2)]
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{TASK}.jsonl"
    with open(data, "w") as f:
        for i in range(rows):
            q, a = pairs[i]
            choices = [a, pairs[i + 1][1], pairs[i + 2][1]]
            rng.shuffle(choices)
            row = {"question": q, "choices": choices, "answer": choices.index(a)}
            f.write(json.dumps(row) + "\n")
    yaml = out / f"{TASK}.yaml"
    yaml.write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '<START_Q>{{question}}<END_Q><START_A>'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    return yaml
