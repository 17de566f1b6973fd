"""A tiny Llama with its own tokenizer, and two local lm-eval task YAMLs over jsonl rows
(a multiple-choice task and a generative one) for the benchmark tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

MC, GEN = "raylift_tiny_mc", "raylift_tiny_gen"


def write_model_and_tasks(root: Path, seed: int = 5) -> tuple[Path, list[str]]:
    """The model folder and the two task YAMLs (7 and 3 rows: odd, so one rank's share
    is padded)."""
    from transformers import AutoTokenizer

    from tools.tiny import build_model, qa_pair, train_tokenizer

    rng = random.Random(3)
    model = root / "model"
    train_tokenizer(model, [" ".join(qa_pair(rng)) for _ in range(300)], vocab_size=300)
    build_model(model, len(AutoTokenizer.from_pretrained(str(model))), hidden=32, seed=seed)
    mc_rows, gen_rows = [], []
    for i in range(7):
        q, a = qa_pair(rng)
        wrong = [qa_pair(rng)[1] for _ in range(2 + i % 2)]  # 3 or 4 choices
        choices = [*wrong[:1], a, *wrong[1:]] if i % 3 else [a, *wrong]
        mc_rows.append({"question": q, "choices": choices, "answer": choices.index(a)})
    for _ in range(3):
        q, a = qa_pair(rng)
        gen_rows.append({"question": q, "answer": a})
    specs = []
    for name, rows, body in (
        (
            MC,
            mc_rows,
            "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        ),
        (
            GEN,
            gen_rows,
            "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
            "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['.']\n"
            "  max_gen_toks: 6\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
    ):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml = root / f"{name}.yaml"
        yaml.write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}"
        )
        specs.append(str(yaml))
    return model, specs
