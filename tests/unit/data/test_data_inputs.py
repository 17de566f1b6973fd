"""Data inputs and shapes: many files in every format (local and S3) give one token stream;
bad rows are named by file:line in every format; instruction and chat rows keep their loss
masks through packing; long rows are split or dropped and counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.data import TEMPLATE, write
from trainer.data.blocks import PackedBlocks
from trainer.data.sources import Example
from trainer.data.tokenize import IGNORE, Settings, prepare
from trainer.errors import DataError, UserError
from trainer.model.loading import load_tokenizer

ROWS = [{"text": f"row {i}: Ana has {i} pens and {2 * i} books."} for i in range(60)]


# A minimal chat template: each turn is <|role|>content, assistant turns end with EOS.
@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny["model"], str(tiny["tokens"]))


def sharded(folder: Path, rows: list) -> Path:
    """The rows over four files, one per format, whose sorted names keep the row order."""
    fmts = [".jsonl.gz", ".jsonl.zst", ".parquet", ".jsonl"]
    step = len(rows) // len(fmts)
    for i, fmt in enumerate(fmts):
        write(folder / f"part-{i}{fmt}", rows[i * step : (i + 1) * step])
    return folder


def all_blocks(cache, block: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = PackedBlocks(cache, block)
    return blocks.gather(np.arange(len(blocks)))


def test_every_format_folder_and_glob_give_one_stream(tmp_path, tokenizer):
    one = write(tmp_path / "one.jsonl", ROWS)
    folder = sharded(tmp_path / "sharded", ROWS)
    ref = prepare(one, tokenizer, progress=False)
    ref_ids, _ = all_blocks(ref, 16)
    for spec in (folder, f"{folder}/part-*"):
        cache = prepare(spec, tokenizer, progress=False, cache_root=str(tmp_path / "c"))
        meta = cache.meta
        assert [Path(s["source"]).name for s in meta["shards"]] == [
            "part-0.jsonl.gz",
            "part-1.jsonl.zst",
            "part-2.parquet",
            "part-3.jsonl",
        ]
        assert meta["documents"] == len(ROWS) and len(meta["shards"]) == 4
        assert np.array_equal(cache.tokens(), ref.tokens())
        # Blocks that straddle shard boundaries read the same tokens as the single file.
        ids, labels = all_blocks(cache, 16)
        assert np.array_equal(ids, ref_ids) and np.array_equal(labels, ids)


@pytest.mark.parametrize(
    ("name", "bad", "where"),
    [
        ("part-2.jsonl.gz", '{"text": "cut', ":3: not valid JSON"),
        ("part-2.jsonl.zst", '{"txt": "x"}', ":3: the row fits no shape"),
        ("part-2.parquet", {"text": None}, ':row 3: "text" must be a string'),
    ],
)
def test_bad_row_is_named_in_every_format(tmp_path, tokenizer, name, bad, where):
    folder = tmp_path / "d"
    write(folder / "part-0.jsonl", ROWS[:5])
    write(folder / "part-1.jsonl", ROWS[5:10])
    write(folder / name, [*ROWS[10:12], bad, *ROWS[12:14]])
    with pytest.raises(DataError, match=rf"{folder.resolve()}/{name}{where}"):
        prepare(folder, tokenizer, progress=False)


def test_truncated_gzip_is_named(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl.gz", ROWS)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"d\.jsonl\.gz:\d+: cannot decompress"):
        prepare(path, tokenizer, progress=False)


CHAT = [
    {"prompt": "What is 2 plus 3?", "completion": "2 plus 3 is 5."},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Ana has 4 pens. How many?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And Ben?"},
            {"role": "assistant", "content": "Ben has 7."},
        ]
    },
]
CHAT_MESSAGES = tuple(CHAT[1]["messages"])


def test_chat_rows_train_on_completions_only(tmp_path, tokenizer):
    data = write(tmp_path / "chat.jsonl", CHAT)
    settings = Settings(chat_template=TEMPLATE, block_size=8)
    cache = prepare(data, tokenizer, progress=False, settings=settings)
    ids, labels = all_blocks(cache, cache.meta["num_tokens"])  # one block: the whole stream
    ids, labels = ids[0], labels[0]

    def text(sel):
        return tokenizer.decode(ids[sel].tolist(), skip_special_tokens=False)

    eos = tokenizer.eos_token
    assert text(labels != IGNORE) == f"2 plus 3 is 5.{eos}Four.{eos}Ben has 7.{eos}"
    masked = text(labels == IGNORE)
    for prompt in ("What is 2 plus 3?", "Be brief.", "Ana has 4 pens. How many?", "And Ben?"):
        assert prompt in masked
    assert (labels[labels != IGNORE] == ids[labels != IGNORE]).all()
    # Blocks of 8 split the rows; the masks stay aligned to their tokens.
    small_ids, small_labels = all_blocks(cache, 8)
    n = small_ids.size
    assert np.array_equal(small_ids.ravel(), ids[:n])
    assert np.array_equal(small_labels.ravel(), labels[:n])
    assert cache.meta["long_rows"] == 2  # both rows are longer than 8 tokens: split

    # loss_on: all keeps every token (a new cache: the setting is part of its key).
    every = prepare(
        data, tokenizer, progress=False, settings=Settings(chat_template=TEMPLATE, loss_on="all")
    )
    assert every.dir != cache.dir
    all_ids, all_labels = all_blocks(every, every.meta["num_tokens"])
    assert np.array_equal(all_ids[0], ids) and np.array_equal(all_labels[0], ids)


def test_text_rows_before_chat_rows_stay_in_the_loss(tmp_path, tokenizer):
    """The shard writer starts the mask file at the first masked row; the text rows written
    before it are all loss. (A source has one shape family, so through `prepare` a shard
    is all text or all masked; the writer keeps the general case right anyway.)"""
    from trainer.data.tokenize import Encoder, _ShardWriter

    settings = Settings(chat_template=TEMPLATE)
    enc = Encoder(tokenizer, settings)
    text = enc.encode([Example(text=r["text"]) for r in ROWS[:10]])
    (chat,) = enc.encode([Example(messages=CHAT_MESSAGES)])
    writer = _ShardWriter(tmp_path, "s", np.uint16, settings, "mixed")
    writer.add(text)
    writer.add([chat])
    writer.close()
    n = sum(len(ids) for ids, _ in text)
    mask = np.frombuffer((tmp_path / "s.mask").read_bytes(), np.uint8)
    assert writer.stats.masked and len(mask) == n + len(chat[0])
    assert mask[:n].all() and np.array_equal(mask[n:], chat[1])
    assert writer.stats.trained == n + int(chat[1].sum())


def test_loss_is_the_mean_over_completion_tokens(tmp_path, tokenizer, tiny):
    """What the loop computes, model(input_ids, labels): only completion tokens count."""
    import torch
    from transformers import AutoModelForCausalLM

    data = write(tmp_path / "chat.jsonl", CHAT * 4)
    cache = prepare(data, tokenizer, progress=False, settings=Settings(chat_template=TEMPLATE))
    ids, labels = all_blocks(cache, 32)
    x, y = torch.from_numpy(ids), torch.from_numpy(labels)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny["model"])
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        out = model(input_ids=x, labels=y)
        logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None])[..., 0]
    keep = y[:, 1:] != IGNORE
    assert 0 < int(keep.sum()) < keep.numel()
    assert float(out.loss) == pytest.approx(float(nll[keep].mean()), rel=1e-5)
    assert float(out.loss) != pytest.approx(float(nll.mean()), rel=1e-3)


def test_long_rows_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"text": "short"}, {"text": " ".join(["word"] * 40)}, {"text": "tiny"}]
    data = write(tmp_path / "d.jsonl", rows)
    cache = prepare(
        data, tokenizer, progress=False, settings=Settings(long_rows="drop", block_size=16)
    )
    meta = cache.meta
    assert (meta["long_rows"], meta["dropped_rows"], meta["documents"]) == (1, 1, 3)
    short = prepare(write(tmp_path / "s.jsonl", [rows[0], rows[2]]), tokenizer, progress=False)
    assert np.array_equal(cache.tokens(), short.tokens())


def test_chat_rows_without_a_template_are_one_line(tmp_path, tokenizer):
    data = write(tmp_path / "chat.jsonl", CHAT)
    with pytest.raises(UserError, match=r"set data\.chat_template") as err:
        prepare(data, tokenizer, progress=False)
    assert "\n" not in str(err.value)


def test_s3_prefix_reads_like_local_and_reuses_its_cache(
    tmp_path, tokenizer, s3_server, monkeypatch
):
    import trainer.data.tokenize as data_mod

    client, bucket = s3_server["client"], s3_server["bucket"]
    folder = sharded(tmp_path / "sharded", ROWS)
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), bucket, f"corpus/{path.name}")
    settings = Settings(endpoint=s3_server["endpoint"])
    spec = f"s3://{bucket}/corpus/"
    calls = []
    real = data_mod.Encoder.encode

    def counting(self, batch):
        calls.append(len(batch))
        return real(self, batch)

    monkeypatch.setattr(data_mod.Encoder, "encode", counting)
    cache = prepare(spec, tokenizer, progress=False, settings=settings, cache_root=tmp_path)
    ref = prepare(folder, tokenizer, progress=False)
    assert np.array_equal(cache.tokens(), ref.tokens())
    assert cache.meta["shards"][2]["source"] == f"s3://{bucket}/corpus/part-2.parquet"
    before = sum(calls)
    again = prepare(spec, tokenizer, progress=False, settings=settings, cache_root=tmp_path)
    assert again.dir == cache.dir and sum(calls) == before  # reused, nothing re-read
    client.put_object(Bucket=bucket, Key="corpus/part-3.jsonl", Body=b'{"text": "new"}\n')
    changed = prepare(spec, tokenizer, progress=False, settings=settings, cache_root=tmp_path)
    assert changed.dir != cache.dir and changed.meta["documents"] == 46


def test_cluster_tokenizing_is_chosen_for_many_files_on_ray(tmp_path, monkeypatch, tiny):
    from trainer.config import load_config
    from trainer.runtime.launch import _tokenize_on_cluster

    folder = sharded(tmp_path / "sharded", ROWS)
    base = {
        "model": {"path": str(tiny["model"])},
        "data": {"train_file": str(folder)},
        "run": {"name": "t"},
    }
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert not _tokenize_on_cluster(load_config(base))  # no Ray cluster
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert _tokenize_on_cluster(load_config(base))
    assert _tokenize_on_cluster(load_config(base, [f"data.train_file={folder}/part-*"]))
    one = str(folder / "part-3.jsonl")
    assert not _tokenize_on_cluster(load_config(base, [f"data.train_file={one}"]))
    assert _tokenize_on_cluster(
        load_config(base, [f"data.train_file={one}", "data.tokenize_on=cluster"])
    )
    assert not _tokenize_on_cluster(load_config(base, ["data.tokenize_on=driver"]))


@pytest.mark.parametrize("bound", ["_BATCH_DOCS", "_BATCH_CHARS"])
def test_batches_and_the_read_ahead_thread_change_no_byte(tmp_path, tokenizer, monkeypatch, bound):
    """Batches cut by rows or by characters, encoded in a helper thread while the next is
    read (the driver) or inline (a one-CPU cluster task): the same shard bytes and mask."""
    import trainer.data.tokenize as data_mod
    from trainer.data.sources import list_sources

    data = write(tmp_path / "chat.jsonl", [*CHAT * 20, *CHAT[:1]])
    (src,) = list_sources(str(data))
    settings = Settings(chat_template=TEMPLATE)
    out = {}
    for name, small, overlap in (
        ("whole", False, True),
        ("ahead", True, True),
        ("inline", True, False),
    ):
        if small:
            monkeypatch.setattr(data_mod, bound, 5 if bound == "_BATCH_DOCS" else 200)
        folder = tmp_path / name
        folder.mkdir()
        stats = data_mod.tokenize_file(src, "s", folder, tokenizer, settings, overlap=overlap)
        out[name] = (
            (folder / "s.bin").read_bytes(),
            (folder / "s.mask").read_bytes(),
            stats.documents,
        )
    assert out["whole"] == out["ahead"] == out["inline"]
    assert out["whole"][2] == len(CHAT) * 20 + 1


SHIPPED_WORKER = """
import pickle, sys
from pathlib import Path
from trainer.data.tokenize import Settings, tokenize_file
from trainer.data.sources import list_sources

tok = pickle.loads(Path(sys.argv[1]).read_bytes())
settings = pickle.loads(Path(sys.argv[2]).read_bytes())
for name in sys.argv[4:]:
    (src,) = list_sources(name)
    tokenize_file(src, Path(name).stem, Path(sys.argv[3]), tok, settings, overlap=False)
    print(Path(name).stem, "transformers" in sys.modules)
"""


def test_a_shipped_tokenizer_encodes_text_without_transformers_and_chat_the_same(
    tmp_path, tokenizer
):
    """Cluster tasks get a ShippedTokenizer: a fresh worker process tokenizes text rows
    without importing transformers (seconds of a node's CPU per worker), renders chat rows
    with the full tokenizer's template all the same, and writes the very shards the full
    tokenizer writes."""
    import pickle
    import subprocess
    import sys

    from trainer.data.sources import list_sources
    from trainer.data.tokenize import ShippedTokenizer, tokenize_file

    text = write(tmp_path / "in" / "text.jsonl", ROWS)
    chat = write(tmp_path / "in" / "chat.jsonl", CHAT)
    settings = Settings(chat_template=TEMPLATE)
    (tmp_path / "tok.pkl").write_bytes(pickle.dumps(ShippedTokenizer(tokenizer)))
    (tmp_path / "settings.pkl").write_bytes(pickle.dumps(settings))
    shipped, full = tmp_path / "shipped", tmp_path / "full"
    shipped.mkdir()
    full.mkdir()
    res = subprocess.run(
        [sys.executable, "-c", SHIPPED_WORKER, str(tmp_path / "tok.pkl"),
         str(tmp_path / "settings.pkl"), str(shipped), str(text), str(chat)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    # text first: no transformers; the chat file needed the template renderer
    assert res.stdout.split() == ["text", "False", "chat", "True"]
    for path in (text, chat):
        (src,) = list_sources(str(path))
        tokenize_file(src, path.stem, full, tokenizer, settings, overlap=False)
    written = sorted(p.name for p in full.iterdir())
    assert written == sorted(p.name for p in shipped.iterdir())
    assert any(n.endswith(".mask") for n in written)  # the chat rows' loss mask is compared too
    for name in written:
        assert (shipped / name).read_bytes() == (full / name).read_bytes(), name
