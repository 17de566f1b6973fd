"""Prompt rows for online RL: a `prompt` (text, or chat messages) and any other columns,
which go to the reward functions untouched (GSM8K's `answer`, a test suite, an id).

The driver reads them once with the project's sources (local, S3, parquet, compressed
jsonl, data.columns' renames, on_bad_line) and writes them as one jsonl file in the cache
folder, which every worker reads whole: a prompt set is small next to a pretraining
corpus, and each rollout tokenizes only its own prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from trainer.config import JobConfig
from trainer.data.sources import ScanReport, iter_parsed, list_sources
from trainer.data.tokenize import cache_dir_for, source_fingerprint
from trainer.errors import DataError
from trainer.rollouts.rows import PromptRow, parse_prompt_row

log = logging.getLogger(__name__)

FILE = "prompts.jsonl"


def prepare_prompts(cfg: JobConfig) -> list[str]:
    """The driver's step: every prompt row of data.train_file, in one file; its folder."""
    (spec,) = cfg.data.sources("train")
    d = cfg.data
    endpoint, region = cfg.storage.endpoint_override, cfg.storage.region
    files = list_sources(spec.path, endpoint, region)
    mapping = d.columns_for(spec)
    key = hashlib.sha256(json.dumps(sorted(mapping.items())).encode())
    for src in files:
        key.update(source_fingerprint(src).encode())
    out = cache_dir_for(spec.path, files, d.cache_dir, "rl-prompts-" + key.hexdigest()[:16])
    if (out / FILE).is_file():
        return [str(out)]
    report = ScanReport()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (FILE + ".partial")
    with open(tmp, "w") as f:
        for src in files:
            rows = iter_parsed(
                src, d.on_bad_line, report, lambda o: parse_prompt_row(o, mapping), endpoint, region
            )
            for row in rows:
                f.write(json.dumps({"prompt": row.prompt, "columns": row.columns}) + "\n")
    if report.documents == 0:
        raise DataError(f"{spec.path}: no prompt rows ({report.skipped} skipped)")
    tmp.rename(out / FILE)
    log.info("%d prompt rows from %s (%d skipped)", report.documents, spec.path, report.skipped)
    return [str(out)]


def read_prompts(folder: str) -> list[PromptRow]:
    with open(Path(folder) / FILE) as f:
        return [PromptRow(r["prompt"], r["columns"]) for r in map(json.loads, f)]
