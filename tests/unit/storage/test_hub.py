"""Hub ids as model and data paths, resolved by huggingface_hub itself in offline mode
(HF_HUB_OFFLINE=1) over a cache in its documented layout (blobs/, snapshots/<commit>/,
refs/main): a tiny Llama and a tiny preference dataset resolve to folders the trainer
reads as local ones, the commit is recorded in the run's folder and a second attempt stays
on it after the branch moved, and an id that cannot be resolved is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.hub import card, commit, model_files
from trainer.config import load_config
from trainer.errors import UserError
from trainer.storage import hub

MODEL, DATA = "tiny-org/tiny-llama", "tiny-org/tiny-pairs"
CARD = card({"train": "data/train-*.jsonl", "test": "data/test-*.jsonl"})


def _rows(n: int, answer: str) -> bytes:
    rows = [{"prompt": f"q{i}", "chosen": f"{answer} {i}", "rejected": f"no {i}"} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _cfg(tmp: Path, model: str = MODEL, data: str = f"hf://datasets/{DATA}", run: str = "r1"):
    return load_config(
        {
            "model": {"path": model},
            "data": {"train_file": data, "block_size": 64, "cache_dir": str(tmp / "shared")},
            "train": {"objective": "dpo", "max_steps": 1},
            "scaling": {"num_workers": 1},
            "storage": {"path": str(tmp / "runs")},
            "run": {"name": run},
        }
    )


def _hub_cache(tiny, tmp: Path) -> tuple[Path, str, str]:
    cache = tmp / "shared" / "hub"
    model = commit(cache, "model", MODEL, model_files(Path(tiny["model"])), 0)
    data = {
        "README.md": CARD,
        "data/train-00000.jsonl": _rows(4, "yes"),
        "data/test-00000.jsonl": _rows(2, "yes"),
    }
    return cache, model, commit(cache, "dataset", DATA, data, 0)


def test_hub_ids_resolve_offline_and_are_pinned(tiny, tmp_path: Path, offline) -> None:
    from transformers import AutoConfig

    from trainer.data.sources import list_local
    from trainer.objectives.rows import parse_pair

    cache, model_rev, data_rev = _hub_cache(tiny, tmp_path)
    cfg = hub.resolve_job(_cfg(tmp_path))
    # The model: the snapshot folder, read as any local model folder.
    assert (
        Path(cfg.model.path) == cache / f"models--{MODEL.replace('/', '--')}/snapshots/{model_rev}"
    )
    assert AutoConfig.from_pretrained(cfg.model.path).model_type == "llama"
    # The dataset: the card's train split, and only it.
    files = list_local(cfg.data.train_file)
    assert [Path(f.uri).name for f in files] == ["train-00000.jsonl"]
    assert parse_pair(json.loads(Path(files[0].uri).read_text().splitlines()[0]))[0] is not None
    record = json.loads((tmp_path / "runs" / "r1" / hub.RECORD).read_text())
    assert record[MODEL]["revision"] == model_rev
    assert record[f"hf://datasets/{DATA}"]["revision"] == data_rev

    # The branch moves on: this run's next attempt stays on its commit and reuses the
    # fetched copy; a new run takes the new commit.
    new = {"README.md": CARD, "data/train-00000.jsonl": _rows(6, "yes")}
    moved = commit(cache, "dataset", DATA, new, 1)
    again = hub.resolve_job(_cfg(tmp_path))
    assert again.data.train_file == cfg.data.train_file and data_rev in again.data.train_file
    other = hub.resolve_job(_cfg(tmp_path, run="r2"))
    assert moved in other.data.train_file
    assert len(Path(list_local(other.data.train_file)[0].uri).read_text().splitlines()) == 6


def test_a_named_split_and_a_pinned_revision(tiny, tmp_path: Path, offline) -> None:
    _, model_rev, data_rev = _hub_cache(tiny, tmp_path)
    cfg = hub.resolve_job(
        _cfg(tmp_path, model=f"hf://{MODEL}@{model_rev}", data=f"hf://datasets/{DATA}/default:test")
    )
    assert cfg.model.path.endswith(model_rev)
    assert cfg.data.train_file.endswith("data/test-*.jsonl") and data_rev in cfg.data.train_file


@pytest.mark.parametrize(
    ("model", "data", "problem"),
    [
        ("tiny-org/missing", f"hf://datasets/{DATA}", "holds no copy of tiny-org/missing@main"),
        (MODEL, f"hf://datasets/{DATA}:validation", "has no split 'validation'"),
        (MODEL, f"hf://datasets/{DATA}/other:train", "has configs default; name one"),
        (MODEL, "hf://datasets/just-a-name", "not a Hub id"),
    ],
)
def test_unresolvable_ids_are_one_line(tiny, tmp_path, offline, model, data, problem) -> None:
    _hub_cache(tiny, tmp_path)
    with pytest.raises(UserError) as err:
        hub.resolve_job(_cfg(tmp_path, model=model, data=data))
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_what_counts_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = hub.parse("hf://datasets/org/name@abc/cfg:test", dataset=True)
    assert ref == hub.HubRef(
        "hf://datasets/org/name@abc/cfg:test", "dataset", "org/name", "abc", "cfg", "test"
    )
    assert (
        hub.parse("Qwen/Qwen2.5-7B-Instruct", dataset=False).repo_id == "Qwen/Qwen2.5-7B-Instruct"
    )
    assert hub.parse("HuggingFaceH4/ultrafeedback_binarized", dataset=True).repo_type == "dataset"
    assert hub.parse("data/train.jsonl", dataset=True) is None  # a data file name
    assert hub.parse("/abs/model", dataset=False) is None and hub.parse("s3://b/m", False) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert hub.parse("models/mine", dataset=False) is None  # a local folder wins
    job = _cfg(tmp_path, model=str(tmp_path / "models" / "mine"), data=str(tmp_path / "d.jsonl"))
    assert hub.resolve_job(job) is job  # no Hub ids: nothing fetched or recorded
    assert not (tmp_path / "runs").exists()


def test_submit_keeps_hub_ids_as_written(tmp_path: Path) -> None:
    """`raylift run` makes relative paths absolute; a Hub id is no path."""
    from tools.jobcli.submit import absolutize

    job = _cfg(tmp_path, model="Qwen/Qwen2.5-0.5B-Instruct", data="HuggingFaceH4/tiny_pairs")
    out = absolutize(job, tmp_path)
    assert out.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert out.data.train_file == "HuggingFaceH4/tiny_pairs"
    rel = absolutize(_cfg(tmp_path, data="data/train.jsonl"), tmp_path)
    assert rel.data.train_file == str(tmp_path / "data" / "train.jsonl")


def test_submit_makes_a_reward_files_path_absolute_as_data_paths(tmp_path: Path) -> None:
    """The job runs in an uploaded folder holding only job.yaml: a reward file given
    relative to where `raylift run` was typed is read from there, as data paths are."""
    from tools.jobcli.submit import absolutize

    rl = {"rewards": [{"function": "rw/score.py:exact"}, {"function": "math_answer"}]}
    job = load_config(
        {
            "model": {"path": str(tmp_path / "m")},
            "data": {"train_file": "data/prompts.jsonl"},
            "train": {"objective": "grpo", "max_steps": 1, "global_batch_size": 8, "rl": rl},
            "scaling": {"num_workers": 1},
            "run": {"name": "r1"},
        }
    )
    out = absolutize(job, tmp_path)
    got = [r.function for r in out.train.rl.rewards]
    assert got == [f"{tmp_path / 'rw' / 'score.py'}:exact", "math_answer"]
    assert out.data.train_file == str(tmp_path / "data" / "prompts.jsonl")


def test_gated_repos_take_the_token_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub is not reachable here: its answer to a gated repository without access is
    stood in for by the error huggingface_hub raises for it."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    seen = {}

    def gated(repo_id: str, **kw):
        seen.update(kw)
        request = httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
        raise GatedRepoError(
            "401: access to this model is restricted",
            response=httpx2.Response(401, request=request),
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with pytest.raises(UserError) as err:
        hub.resolve_job(_cfg(tmp_path, model="meta-llama/Llama-3.1-8B"))
    assert seen["token"] == "hf_secret"
    assert "a gated model on the Hub" in str(err.value) and "HF_TOKEN" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_mix_and_an_eval_set_from_the_hub(tiny, tmp_path: Path, offline) -> None:
    _, _, data_rev = _hub_cache(tiny, tmp_path)
    local = tmp_path / "local.jsonl"
    local.write_text('{"text": "hello"}\n')
    job = load_config(
        {
            "model": {"path": MODEL, "tokenizer": f"hf://{MODEL}"},
            "data": {
                "train_file": [
                    {"path": f"hf://datasets/{DATA}", "weight": 2, "name": "hub"},
                    str(local),
                ],
                "eval_file": f"hf://datasets/{DATA}:test",
                "cache_dir": str(tmp_path / "shared"),
            },
            "scaling": {"num_workers": 1},
            "storage": {"path": str(tmp_path / "runs")},
            "run": {"name": "mix"},
        }
    )
    out = hub.resolve_job(job)
    hub_src, local_src = out.data.sources("train")
    assert (hub_src.name, hub_src.weight) == ("hub", 2) and data_rev in hub_src.path
    assert local_src.path == str(local)
    assert out.data.eval_file.endswith("data/test-*.jsonl")
    assert out.model.tokenizer == out.model.path
