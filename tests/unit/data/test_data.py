"""Data pipeline: formats, malformed lines, the tokenized cache, and the batch plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data.blocks import BatchPlan, PackedBlocks, eval_indices
from trainer.data.shapes import iter_examples
from trainer.data.sources import ScanReport, list_sources
from trainer.data.tokenize import TokenizerFiles, load_special_tokens, prepare
from trainer.errors import DataError
from trainer.model.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny["model"], str(tiny["tokens"]))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_special_tokens_are_single_tokens(tokenizer, tiny):
    tokens = load_special_tokens(tiny["tokens"])
    for tok in tokens:
        ids = tokenizer.backend_tokenizer.encode(tok, add_special_tokens=False).ids
        assert len(ids) == 1, tok
    assert len(tokenizer) == 512 + len(tokens)


def test_both_formats_and_eos_kept(tmp_path, tokenizer):
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"text": "Ana has 3 pens."}, {"input": "<START_Q>hi<END_Q>"}]
    )
    cache = prepare(data, tokenizer, progress=False)
    ids = np.asarray(cache.tokens())
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    assert cache.meta["documents"] == 2
    # Each document is BOS … EOS, so the model learns to stop (EOS is never padding here).
    assert ids[0] == bos and int((ids == eos).sum()) == 2 and ids[-1] == eos
    assert tokenizer.convert_tokens_to_ids("<START_Q>") in ids


def test_malformed_line_error_and_skip(tmp_path, tokenizer):
    rows = [{"text": "one"}, '{"text": "two"', {"text": 3}, {"text": "four"}, ""]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=rf"{data}:2: not valid JSON"):
        prepare(data, tokenizer, progress=False)
    cache = prepare(data, tokenizer, on_bad_line="skip", progress=False)
    meta = cache.meta
    assert (meta["documents"], meta["skipped_lines"]) == (2, 2)
    assert meta["first_skipped"][0].startswith(f"{data}:2:")
    assert meta["first_skipped"][1].startswith(f'{data}:3: "text" must be a string')


def test_iter_examples_counts(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "[1, 2]", {"input": "b"}])
    report = ScanReport()
    (src,) = list_sources(str(data))
    assert [e.text for e in iter_examples(src, "skip", report)] == ["a", "b"]
    assert (report.documents, report.skipped) == (2, 1)


def test_cache_is_reused_and_invalidated(tmp_path, tokenizer, monkeypatch):
    import trainer.data.tokenize as data_mod

    encoded = []
    real_encode = data_mod.Encoder.encode

    def counting(self, batch):
        encoded.append(len(batch))
        return real_encode(self, batch)

    monkeypatch.setattr(data_mod.Encoder, "encode", counting)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "Ana has 3 pens."}] * 10)
    first = prepare(data, tokenizer, progress=False)
    assert sum(encoded) == 10
    stamp = (first.dir / "shard-00000.bin").stat().st_mtime_ns
    again = prepare(data, tokenizer, progress=False)
    # Reused: same folder, the tokenizer was not called again, the file was not rewritten.
    assert again.dir == first.dir and sum(encoded) == 10
    assert (again.dir / "shard-00000.bin").stat().st_mtime_ns == stamp
    write_jsonl(data, [{"text": "Ben has 4 books."}] * 11)
    second = prepare(data, tokenizer, progress=False)
    assert second.dir != first.dir and second.meta["documents"] == 11
    assert sum(encoded) == 21
    # No temp folders are left behind next to the caches.
    assert not [p for p in first.dir.parent.iterdir() if ".tmp-" in p.name]


def test_tokenizer_files_key_the_cache_and_a_hit_never_loads_transformers(tmp_path, tiny):
    """The driver names the tokenizer by its files: a miss loads it and tokenizes exactly
    as the loaded tokenizer does; a hit (a fresh process, as every resubmission is) does not
    import transformers; a changed tokenizer file or special-tokens file is a miss."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "tok"
    shutil.copytree(tiny["model"], folder)
    special = tmp_path / "tokens.json"
    shutil.copy(tiny["tokens"], special)
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "<START_Q>Ana has 3 pens.<END_Q>"}] * 5)
    files = TokenizerFiles(folder, str(special))
    first = prepare(data, files, progress=False)
    loaded = prepare(data, load_tokenizer(folder, str(special)), progress=False)
    assert np.array_equal(first.tokens(), loaded.tokens())

    probe = (
        "import sys; from trainer.data.tokenize import TokenizerFiles, prepare; "
        f"c = prepare({str(data)!r}, TokenizerFiles({str(folder)!r}, {str(special)!r}), "
        "progress=False); print(c.dir, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(first.dir), "False"]

    tokens = json.loads(special.read_text())["tokens"]
    special.write_text(json.dumps({"tokens": [*tokens, "<EXTRA>"]}))
    assert prepare(data, TokenizerFiles(folder, str(special)), progress=False).dir != first.dir
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"model_max_length": 77, ', 1))
    assert len({prepare(data, TokenizerFiles(folder, None), progress=False).dir, first.dir}) == 2


def test_packed_blocks(tmp_path, tokenizer):
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"text": f"row {i} of the corpus"} for i in range(50)]
    )
    cache = prepare(data, tokenizer, progress=False)
    blocks = PackedBlocks(cache, 16)
    assert len(blocks) == cache.meta["num_tokens"] // 16
    got, labels = blocks.gather(np.array([2, 0]))
    flat = np.asarray(cache.tokens())
    assert got.dtype == np.int64 and got.shape == (2, 16)
    assert (got[0] == flat[32:48]).all() and (got[1] == flat[:16]).all()
    assert (labels == got).all()  # text rows: every token is in the loss


def test_plan_shards_are_disjoint_and_cover_the_epoch():
    plan = BatchPlan(num_blocks=103, micro_batch_size=3, grad_accum=2, world_size=4, seed=1)
    assert plan.global_batch == 24 and plan.steps_per_epoch == 4
    seen = []
    for step in range(plan.steps_per_epoch):
        for rank in range(4):
            for mb in plan.step_indices(step, rank):
                assert len(mb) == 3
                seen.extend(mb.tolist())
    assert len(seen) == len(set(seen)) == 96  # no block read twice in an epoch
    # The next epoch is a different order over the same blocks.
    e1 = [i for r in range(4) for mb in plan.step_indices(4, r) for i in mb.tolist()]
    e0 = [i for r in range(4) for mb in plan.step_indices(0, r) for i in mb.tolist()]
    assert e1 != e0


def test_plan_is_world_size_independent():
    """The same global batch reads the same blocks at each step, whatever the split."""
    a = BatchPlan(num_blocks=200, micro_batch_size=2, grad_accum=4, world_size=1, seed=5)
    b = BatchPlan(num_blocks=200, micro_batch_size=2, grad_accum=1, world_size=4, seed=5)
    for step in (0, 3, 11, 30):
        sa = sorted(i for mb in a.step_indices(step, 0) for i in mb.tolist())
        sb = sorted(i for r in range(4) for mb in b.step_indices(step, r) for i in mb.tolist())
        assert sa == sb


def test_eval_indices_split_across_ranks():
    parts = [eval_indices(10, 2, 3, r, None) for r in range(3)]
    flat = sorted(i for p in parts for mb in p for i in mb.tolist() if i >= 0)
    assert flat == list(range(10))
    # Every replica runs as many batches (a sharded forward is a collective): 4 places
    # each, the two past the set marked -1.
    assert [sum(len(mb) for mb in p) for p in parts] == [4, 4, 4]
    assert sum(int((mb < 0).sum()) for p in parts for mb in p) == 2


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_the_eval_set_is_the_same_for_any_layout(replicas, micro):
    """eval_blocks: the first N blocks, whatever the number of replicas or micro batch size
    (an elastic run that shrinks, a pp/tp layout, another grad_accum)."""
    for limit, expected in ((16, range(16)), (None, range(37)), (100, range(37))):
        got = [
            i
            for r in range(replicas)
            for mb in eval_indices(37, micro, replicas, r, limit)
            for i in mb.tolist()
            if i >= 0
        ]
        assert sorted(got) == list(expected)
        assert len(got) == len(set(got))


def test_step_loss_is_the_token_mean_over_micro_batches_even_with_a_prompt_only_one(tiny):
    """Masked prompts: one micro-batch holds no target at all, the other a few. The step's
    loss (the sum of the micro-batch losses the loop backpropagates) is finite and equals
    the mean over every target token of the step, not a mean of per-batch means (which
    is NaN here: Hugging Face's mean over zero targets)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.data.tokenize import IGNORE
    from trainer.loop import _targets_per_rank

    model = AutoModelForCausalLM.from_pretrained(tiny["model"]).eval()
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 200, (2, 16), generator=gen).numpy() for _ in range(2)]
    prompt_only = np.full_like(ids[0], IGNORE)
    some = ids[1].copy()
    some[:, :10] = IGNORE  # 6 targets per row (positions 10-15), 12 in all
    micro = [(ids[0], prompt_only), (ids[1], some)]
    per_rank, flags = _targets_per_rank(micro, torch.device("cpu"), world=1, flags=[1.0])
    assert float(per_rank) == 12.0
    assert flags == [1.0]  # what rides along in the same all-reduce comes back
    with torch.no_grad():
        step_loss = sum(
            model(
                input_ids=torch.from_numpy(x),
                labels=torch.from_numpy(y),
                num_items_in_batch=per_rank,
            ).loss
            for x, y in micro
        )
        plain = model(input_ids=torch.from_numpy(ids[1]), labels=torch.from_numpy(some)).loss
        naive = model(input_ids=torch.from_numpy(ids[0]), labels=torch.from_numpy(prompt_only)).loss
    assert torch.isfinite(step_loss)
    # All twelve targets sit in the second batch, so the token mean is that batch's mean.
    torch.testing.assert_close(step_loss, plain)
    assert torch.isnan(naive)  # what a mean of per-batch means would have added
