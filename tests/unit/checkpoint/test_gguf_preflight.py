"""export.formats gguf for a family the GGUF writer cannot map is refused before launch,
in one line, instead of at the first export after training."""

from __future__ import annotations

import json

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.preflight import Report, check_model


def _job(model_dir: str) -> dict:
    return {
        "model": {"path": model_dir},
        "data": {"train_file": "x.jsonl", "block_size": 16},
        "export": {"formats": ["hf", "gguf"]},
        "run": {"name": "g"},
    }


@pytest.mark.parametrize(("kind", "refused"), [("qwen2", True), ("llama", False)])
def test_gguf_for_a_family_it_cannot_write_is_one_line(tmp_path, kind, refused):
    conf = {
        "model_type": kind,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 96,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(conf))
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = load_config(_job(str(tmp_path)))
    if not refused:
        check_model(cfg, True, Report())
        return
    with pytest.raises(ConfigError) as e:
        check_model(cfg, True, Report())
    msg = str(e.value)
    assert msg.startswith("export.formats: gguf writes model_type llama") and "'qwen2'" in msg
    assert "\n" not in msg
