"""Data at scale on the real local cluster and SeaweedFS: a sharded, gzip-compressed chat
corpus on S3 is tokenized by Ray Data across both worker nodes into the same tokens (and
loss masks) as one local file; a bad row in the third shard is named before training; and
a job on the sharded corpus, its worker killed mid-run, resumes exactly from a checkpoint
in the bucket."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.ray_jobs import history, retrained, run_killed
from trainer.data.blocks import PackedBlocks
from trainer.data.tokenize import IGNORE, Settings, TokenCache, prepare
from trainer.model.loading import load_tokenizer

pytestmark = pytest.mark.slow

# The prompt/completion pair renders back to the Ray template's own text,
# <s><START_Q>…<END_Q><START_A>…<END_A></s>, with the question out of the loss.
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SHARDS = 4


def chat_rows(tiny) -> list[dict[str, str]]:
    rows = []
    for line in tiny["train"].read_text().splitlines():
        text = json.loads(line)["input"]
        cut = text.index("<START_A>")
        rows.append({"prompt": text[:cut], "completion": text[cut:]})
    return rows


def upload_shards(s3, prefix: str, rows: list, bad: tuple[int, int] | None = None) -> str:
    """rows as SHARDS gzip jsonl objects; `bad` = (shard, line) gets a malformed line."""
    step = -(-len(rows) // SHARDS)
    for i in range(SHARDS):
        lines = [json.dumps(r) for r in rows[i * step : (i + 1) * step]]
        if bad and bad[0] == i:
            lines.insert(bad[1] - 1, '{"prompt": "cut off')
        body = gzip.compress(("\n".join(lines) + "\n").encode())
        key = f"{prefix}/part-{i:03d}.jsonl.gz"
        s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=body)
    return f"s3://{s3['bucket']}/{prefix}/"


@pytest.fixture
def corpus(tiny, tmp_path):
    rows = chat_rows(tiny)
    local = tmp_path / "chat.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    return rows, local, template


# Runs as its own Ray driver, in a fresh interpreter: Ray reads its loopback-only setting
# (set by the cluster fixture) when first imported, so this process's Ray would reach
# the cluster through the machine's outward address instead of 127.0.0.1.
DRIVER = """
import json, sys, time
import ray
from trainer.data.tokenize import Settings, prepare
from trainer.data.cluster import tokenize_on_cluster
from trainer.errors import DataError
from trainer.model.loading import load_tokenizer

address, model, tokens, endpoint, template, cache_root, *specs = sys.argv[1:]
tok = load_tokenizer(model, tokens)
settings = Settings(chat_template=template, endpoint=endpoint)
ray.init(address=address, log_to_driver=False)
out = {}
for spec in specs:
    t0 = time.perf_counter()
    try:
        cache = prepare(spec, tok, settings=settings, cache_root=cache_root, progress=False,
                        tokenize_shards=tokenize_on_cluster)
        out[spec] = str(cache.dir)
    except DataError as exc:
        out[spec] = "error: " + str(exc)
    print(f"{spec}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
print(json.dumps(out))
"""


def test_ray_data_tokenizes_s3_shards_on_both_nodes_like_one_local_file(
    ray_cluster, s3_server, tiny, corpus, tmp_path
):
    import subprocess
    import sys

    rows, local, _ = corpus
    tok = load_tokenizer(tiny["model"], str(tiny["tokens"]))
    settings = Settings(chat_template=TEMPLATE, endpoint=s3_server["endpoint"])
    spec = upload_shards(s3_server, "direct", rows)
    bad = upload_shards(s3_server, "direct-bad", rows, bad=(2, 7))
    assert ray_cluster.address.startswith("127.0.0.1:")  # loopback only
    args = [ray_cluster.address, tiny["model"], tiny["tokens"], s3_server["endpoint"]]
    args += [TEMPLATE, tmp_path / "cache", spec, bad]
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, args)], capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out[bad].startswith(f"error: {bad}part-002.jsonl.gz:7: not valid JSON"), out[bad]
    cache = TokenCache(Path(out[spec]))
    meta = cache.meta
    assert len(meta["shards"]) == SHARDS and meta["documents"] == len(rows)
    assert len({s["node"] for s in meta["shards"]}) == 2  # both worker nodes tokenized
    ref = prepare(local, tok, settings=settings, progress=False)
    a, b = PackedBlocks(cache, 32), PackedBlocks(ref, 32)
    assert len(a) == len(b)
    (ids_a, lab_a), (ids_b, lab_b) = a.gather(np.arange(len(a))), b.gather(np.arange(len(b)))
    assert np.array_equal(ids_a, ids_b) and np.array_equal(lab_a, lab_b)
    # The questions are out of the loss, the answers (and the EOS) in it.
    start_q, start_a = tok.convert_tokens_to_ids(["<START_Q>", "<START_A>"])
    assert (lab_a[ids_a == start_q] == IGNORE).all() and (lab_a[ids_a == start_a] != IGNORE).all()
    assert 0.2 < float((lab_a == IGNORE).mean()) < 0.8


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_sharded_s3_chat_run_resumes_exactly_and_matches_the_local_file(
    ray_cluster, s3_server, job, corpus, tiny, tmp_path
):
    """S3 data and S3 storage in one job: the job's driver has Ray Data tokenize the four
    shards on both nodes into the same tokens and loss masks as the local file gives; the
    last rank is killed after step 5 and Ray restarts the group from the step-3 checkpoint
    in the bucket, so steps 4 and 5 are trained twice, identically."""
    rows, local, template = corpus
    spec = upload_shards(s3_server, "train", rows)
    data = {"block_size": 32, "chat_template": str(template), "eval_file": None}
    path = job(
        "data-s3",
        data={**data, "train_file": spec, "cache_dir": str(tmp_path / "cache")},
        storage={
            "path": f"s3://{s3_server['bucket']}/runs",
            "endpoint_override": s3_server["endpoint"],
        },
        train={"max_steps": 6, "eval_every": None, "log_every": 1},
        checkpoint={"every_steps": 3, "keep_last": 1, "upload": "sync"},
    )
    cfg, summary, _ = run_killed(ray_cluster, path, 5)
    listed = s3_server["client"].list_objects_v2(Bucket="ckpt", Prefix="runs/data-s3/")
    keys = {o["Key"] for o in listed["Contents"]}
    for key in (
        "step_00000006/strategy/model.pt",
        "step_00000006/trainer_state.json",
        "export/step_00000006/model/model.safetensors",
        "metrics.jsonl",
    ):
        assert f"runs/data-s3/{key}" in keys, sorted(keys)
    assert summary["checkpoint"] == "s3://ckpt/runs/data-s3/step_00000006"

    records, steps, wasted = history(cfg)
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [3]
    assert wasted == 2 and [r["step"] for r in steps] == list(range(1, 7))
    for step, (first, again) in zip((4, 5), retrained(records, [4, 5]), strict=True):
        assert again == pytest.approx(first, abs=1e-6), step

    (folder,) = list(Path(tmp_path / "cache").iterdir())
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(s["masked"] for s in manifest["shards"])
    assert len({s["node"] for s in manifest["shards"]}) == 2
    tok = load_tokenizer(tiny["model"], str(tiny["tokens"]))
    ref = prepare(local, tok, settings=Settings(chat_template=TEMPLATE), progress=False)
    a, b = PackedBlocks(TokenCache(folder), 32), PackedBlocks(ref, 32)
    assert len(a) == len(b)
    (ids_a, lab_a), (ids_b, lab_b) = a.gather(np.arange(len(a))), b.gather(np.arange(len(b)))
    assert np.array_equal(ids_a, ids_b) and np.array_equal(lab_a, lab_b)
