"""Hugging Face Hub ids as model and data paths, fetched once by the driver.

`model.path: Qwen/Qwen2.5-7B-Instruct` (or `hf://Qwen/Qwen2.5-7B-Instruct@<revision>`) and
`data.train_file: hf://datasets/HuggingFaceH4/ultrafeedback_binarized/default:train_prefs`
(`hf://datasets/org/name[@revision][/config][:split]`, split `train` unless named; a bare
`org/name` that is no local path reads the same) are resolved on the driver, before any
worker starts: huggingface_hub downloads the repository into `<data.cache_dir>/hub`, its
own cache layout (blobs/, snapshots/<commit>/, refs/), on the shared storage the workers
already read the token cache from. The job the workers get names the snapshot folder
(and, for a dataset, the split's files in it), so they read it as a local folder and never
reach the Hub. A second run finds the snapshot and downloads nothing (HF_HUB_OFFLINE=1 works
once it is there).

The commit each id resolved to is recorded in the run's folder (`hub.json`); a restarted
or resubmitted run reads it back and stays on that commit though the branch moved. Gated
and private repositories take the token from HF_TOKEN (the cluster's secret sets it). An id
that cannot be resolved (no such repository, a gated one without access, offline with
nothing cached, no such config or split) is one line before launch.

No torch, and huggingface_hub and pyarrow only inside functions: the laptop's preflight
asks `parse` whether a path is a Hub id.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import UserError

JobConfig = Any
"""trainer.config.JobConfig: storage sits below config and does not import it."""

log = logging.getLogger(__name__)

PREFIX = "hf://"
RECORD = "hub.json"
"""The run's record of the commit each Hub id resolved to."""
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""A model's config, safetensors weights and tokenizer files (not .bin/.h5/.onnx copies)."""
DATA_FILES = ["README.md", *(f"*{s}" for s in DATA_SUFFIXES)]
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class HubRef:
    spec: str  # as the job wrote it
    repo_type: str  # "model" or "dataset"
    repo_id: str
    revision: str | None = None
    config: str | None = None
    split: str = "train"


def parse(spec: str, dataset: bool) -> HubRef | None:
    """The Hub id in a model (`dataset=False`) or data path, or None for any other path.
    A bare `org/name` is a Hub id only where no such local path exists."""
    if spec.startswith(PREFIX):
        rest = spec[len(PREFIX) :]
        for kind in ("datasets/", "models/"):
            if rest.startswith(kind):
                dataset, rest = kind == "datasets/", rest[len(kind) :]
        rest, _, split = rest.partition(":")
        parts = rest.strip("/").split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise UserError(
                f"{spec}: not a Hub id; write hf://org/name (a model) or "
                "hf://datasets/org/name[@revision][/config][:split]"
            )
        name, _, revision = parts[1].partition("@")
        return HubRef(
            spec,
            "dataset" if dataset else "model",
            f"{parts[0]}/{name}",
            revision or None,
            parts[2] if len(parts) == 3 else None,
            split or "train",
        )
    bare = _REPO.match(spec) and not spec.endswith(DATA_SUFFIXES) and not Path(spec).exists()
    if not bare:
        return None
    return HubRef(spec, "dataset" if dataset else "model", spec)


def fetch(ref: HubRef, cache: Path, revision: str | None = None) -> Path:
    """The repository's snapshot folder in `cache`, downloaded if missing; `revision` (a
    recorded commit) overrides the id's own."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    want = revision or ref.revision or "main"
    try:
        folder = snapshot_download(
            ref.repo_id,
            repo_type=ref.repo_type,
            revision=want,
            cache_dir=str(cache),
            token=os.environ.get("HF_TOKEN") or None,
            allow_patterns=MODEL_FILES if ref.repo_type == "model" else DATA_FILES,
        )
    except GatedRepoError:
        raise UserError(
            f"{ref.spec}: a gated {ref.repo_type} on the Hub; accept its terms on "
            "huggingface.co and set HF_TOKEN (the cluster's secret) to a token with access"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{ref.spec}: no {ref.repo_type} {ref.repo_id} on the Hub (or it is private: set "
            "HF_TOKEN); check the id"
        ) from None
    except RevisionNotFoundError:
        raise UserError(f"{ref.spec}: {ref.repo_id} has no revision {want!r}") from None
    except LocalEntryNotFoundError:
        raise UserError(
            f"{ref.spec}: the Hub cannot be reached (offline or HF_HUB_OFFLINE=1) and "
            f"{cache} holds no copy of {ref.repo_id}@{want}; fetch it once with the Hub "
            "reachable, or give a local path"
        ) from None
    except HfHubHTTPError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{ref.spec}: the Hub refused the download: {first}") from None
    return Path(folder)


def readable(snapshot: Path) -> Path:
    """The snapshot's files under their own names, as hard links beside it (once): the
    snapshot's entries are symlinks to blobs named by hash, and the data readers resolve a
    path and tell a file's format by its name."""
    out = snapshot.parent.parent / "files" / snapshot.name
    if out.is_dir():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    for entry in snapshot.rglob("*"):
        if entry.is_dir():
            continue
        target = tmp / entry.relative_to(snapshot)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(entry.resolve(), target)
        except OSError:  # another filesystem: a copy
            shutil.copyfile(entry, target)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process linked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def split_files(ref: HubRef, root: Path) -> str:
    """The data path (a file glob in the snapshot) of the id's config and split: the
    dataset card's `configs` where it has them, else files named after the split."""
    configs = _card_configs(root / "README.md")
    if configs:
        names = [str(c.get("config_name", "default")) for c in configs]
        chosen = ref.config or next(
            (str(c.get("config_name", "default")) for c in configs if c.get("default")),
            "default" if "default" in names else names[0] if len(names) == 1 else None,
        )
        if chosen not in names:
            raise UserError(
                f"{ref.spec}: {ref.repo_id} has configs {', '.join(names)}; name one "
                f"(hf://datasets/{ref.repo_id}/CONFIG:SPLIT)"
            )
        patterns = _split_patterns(configs[names.index(chosen)].get("data_files"), ref.split)
        if patterns is None:
            raise UserError(
                f"{ref.spec}: config {chosen} of {ref.repo_id} has no split {ref.split!r}"
            )
    else:
        base = f"{ref.config}/" if ref.config else ""
        patterns = [f"{base}**/*{ref.split}*"]
    if len(patterns) != 1:
        raise UserError(
            f"{ref.spec}: split {ref.split} is {len(patterns)} file patterns; Raylift reads "
            "one per source: list them as sources of a mix, or give a local copy"
        )
    spec = str(root / patterns[0])
    if not any(f.endswith(DATA_SUFFIXES) for f in glob.glob(spec, recursive=True)):
        raise UserError(
            f"{ref.spec}: no {', '.join(DATA_SUFFIXES)} files for split {ref.split!r} in "
            f"{ref.repo_id} ({patterns[0]})"
        )
    return spec


def _card_configs(readme: Path) -> list[dict[str, Any]]:
    if not readme.is_file():
        return []
    from huggingface_hub import DatasetCard

    configs = DatasetCard.load(readme).data.to_dict().get("configs") or []
    return [c for c in configs if isinstance(c, dict)]


def _split_patterns(data_files: Any, split: str) -> list[str] | None:
    """The card's patterns of one split (data_files: a path, a list of paths, a list of
    {split, path}); a config without splits is all `train`."""
    if isinstance(data_files, str):
        return [data_files] if split == "train" else None
    if not isinstance(data_files, list):
        return None
    if all(isinstance(f, str) for f in data_files):
        return list(data_files) if split == "train" else None
    for entry in data_files:
        if isinstance(entry, dict) and entry.get("split") == split:
            path = entry.get("path")
            return [path] if isinstance(path, str) else list(path or [])
    return None


# ---------------------------------------------------------------- the job


def resolve_job(cfg: JobConfig) -> JobConfig:
    """The job with every Hub id replaced by its local snapshot (a dataset: its split's
    files), each pinned to the commit this run recorded, or recorded now. The driver runs
    this once before preflight; a job without Hub ids comes back as it was."""
    record: dict[str, dict[str, str]] | None = None
    resolved: dict[str, dict[str, str]] = {}

    def local(spec: str | None, dataset: bool) -> str | None:
        nonlocal record
        ref = parse(spec, dataset) if spec else None
        if ref is None:
            return spec
        if record is None:  # only a job with Hub ids reads the run's record
            record = _read_record(cfg)
        pinned = record.get(ref.spec, {}).get("revision")
        folder = fetch(ref, hub_cache(cfg), pinned)
        path = split_files(ref, readable(folder)) if dataset else str(folder)
        resolved[ref.spec] = {
            "type": ref.repo_type,
            "repo": ref.repo_id,
            "revision": folder.name,
            "path": path,
        }
        log.info("%s: %s %s@%s in %s", ref.spec, ref.repo_type, ref.repo_id, folder.name, path)
        return path

    def sources(value: Any) -> Any:
        if value is None or isinstance(value, str):
            return local(value, True)
        return [
            local(v, True)
            if isinstance(v, str)
            else v.model_copy(update={"path": local(v.path, True)})
            for v in value
        ]

    model = cfg.model.model_copy(
        update={
            "path": local(cfg.model.path, False),
            "tokenizer": local(cfg.model.tokenizer, False),
        }
    )
    data = cfg.data.model_copy(
        update={
            "train_file": sources(cfg.data.train_file),
            "eval_file": sources(cfg.data.eval_file),
        }
    )
    if not resolved:
        return cfg
    _write_record(cfg, (record or {}) | resolved)
    return cfg.model_copy(update={"model": model, "data": data})


def hub_cache(cfg: JobConfig) -> Path:
    """Where fetched repositories go: `<data.cache_dir>/hub`, else beside the run's
    storage when that is a shared folder (S3 cannot be read as a folder)."""
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser() / "hub"
    if cfg.storage.path.startswith("s3://"):
        raise UserError(
            "data.cache_dir: Hub ids need a shared folder every node mounts to fetch into "
            "(storage.path is on S3); set data.cache_dir, e.g. to an EFS path"
        )
    return Path(cfg.storage.path).expanduser() / "hub-cache"


def _record_uri(cfg: JobConfig) -> Any:
    from trainer.storage.location import resolve

    run = resolve(cfg.storage.path, cfg.storage.endpoint_override, cfg.storage.region)
    return run.join(cfg.run.name, RECORD)


def _read_record(cfg: JobConfig) -> dict[str, dict[str, str]]:
    loc = _record_uri(cfg)
    try:
        with loc.fs.open_input_stream(loc.path) as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return {}


def _write_record(cfg: JobConfig, record: dict[str, dict[str, str]]) -> None:
    loc = _record_uri(cfg)
    parent = loc.path.rsplit("/", 1)[0]
    loc.fs.create_dir(parent, recursive=True)
    with loc.fs.open_output_stream(loc.path) as f:
        f.write(json.dumps(record, indent=1, sort_keys=True).encode())
