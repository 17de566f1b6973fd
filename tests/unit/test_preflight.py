"""Preflight: checks against the model's config.json, the data and the storage."""

from __future__ import annotations

import json

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError, DataError, UserError
from trainer.preflight import run_all


def test_block_size_beyond_model_positions(job, tiny):
    limit = json.loads((tiny["model"] / "config.json").read_text())["max_position_embeddings"]
    cfg = load_config(job(), [f"data.block_size={limit * 2}"])
    with pytest.raises(
        ConfigError,
        match=f"data.block_size: {limit * 2} exceeds the model's max_position_embeddings {limit}",
    ):
        run_all(cfg)


def test_missing_model_dir(job):
    cfg = load_config(job(), ["model.path=/nonexistent/model"])
    with pytest.raises(UserError, match=r"model\.path /nonexistent/model: not found"):
        run_all(cfg, strict=True)
    # On a client that may not see the cluster's shared FS, it is a note, not an error.
    assert any("model.path" in n for n in run_all(cfg, strict=False).notes)


def test_malformed_line_names_file_and_line(job, tmp_path, tiny):
    bad = tmp_path / "bad.jsonl"
    lines = tiny["train"].read_text().splitlines()[:5]
    lines.insert(2, '{"input": "unterminated')
    bad.write_text("\n".join(lines) + "\n")
    cfg = load_config(job(), [f"data.train_file={bad}"])
    with pytest.raises(DataError, match=rf"{bad}:3: not valid JSON"):
        run_all(cfg)


def test_bad_special_tokens_file(job, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"tokens": "<A>"}')
    cfg = load_config(job(), [f"model.special_tokens={tokens}"])
    with pytest.raises(DataError, match="expected"):
        run_all(cfg)


def test_storage_not_writable(job, tmp_path):
    locked = tmp_path / "locked"
    locked.write_text("a file, not a directory")
    cfg = load_config(job(), [f"storage.path={locked}/runs"])
    with pytest.raises(UserError, match="not writable"):
        run_all(cfg)


def test_unreachable_s3_endpoint_is_one_clear_error(job):
    # Port 1 on loopback: nothing listens, so the connection is refused at once.
    cfg = load_config(
        job(), ["storage.path=s3://bucket/runs", "storage.endpoint_override=http://127.0.0.1:1"]
    )
    with pytest.raises(UserError, match=r"storage.path s3://bucket/runs: not writable: .*connect"):
        run_all(cfg)


def test_ram_tier_with_deepspeed_is_refused_in_one_line(job):
    """checkpoint.memory_every has no DeepSpeed path: refused before any worker starts,
    naming the field and what to do; the same job on DDP passes."""
    path = job(
        "ds-mem",
        strategy={"name": "deepspeed", "config": "zero2"},
        checkpoint={"memory_every": 1},
    )
    with pytest.raises(ConfigError) as exc:
        run_all(load_config(path))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("checkpoint.memory_every:")
    assert "DeepSpeed" in msg and "memory_every: 0" in msg
    run_all(load_config(job("ddp-mem", checkpoint={"memory_every": 1})))
