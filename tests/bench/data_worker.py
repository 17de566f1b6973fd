"""One data-pipeline run in a fresh process (for a clean peak RSS):
data_worker.py raylift|hf|hf2|reads|ray1|ray2|procs1|procs2 MODEL CORPUS BLOCK WORKDIR OUT.json

reads: read every block of one epoch, in training order, from the cache `raylift` built
in WORKDIR. rayN: tokenize CORPUS (a folder of files) with Ray Data on a local cluster of
N one-CPU nodes (the cluster's start is not timed). procsN: the same files split over N
plain processes of one tokenizer thread each, no Ray: what N cores of this machine give
this work, start-up of the processes included (the ceiling for rayN)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def raylift(model: str, corpus: str, block: int, workdir: str) -> int:
    from trainer.data.blocks import PackedBlocks
    from trainer.data.tokenize import prepare
    from trainer.model.loading import load_tokenizer

    tok = load_tokenizer(Path(model), None)
    cache = prepare(corpus, tok, cache_root=f"{workdir}/raylift-cache", progress=False)
    return len(PackedBlocks(cache, block)) * block


def reads(model: str, corpus: str, block: int, workdir: str) -> int:
    from trainer.data.blocks import BatchPlan, PackedBlocks, StepBatches
    from trainer.data.tokenize import prepare
    from trainer.model.loading import load_tokenizer

    tok = load_tokenizer(Path(model), None)
    cache = prepare(corpus, tok, cache_root=f"{workdir}/raylift-cache", progress=False)
    blocks = PackedBlocks(cache, block)
    plan = BatchPlan(len(blocks), micro_batch_size=8, grad_accum=1, world_size=1, seed=0)
    batches = StepBatches(blocks, plan, 0)
    total = 0
    for step in range(plan.steps_per_epoch):
        for ids, _labels in batches.micro_batches(step):
            total += ids.size
    return total


def on_ray(model: str, corpus: str, block: int, workdir: str, nodes: int) -> tuple[int, float]:
    # `ray` is imported only once the cluster has set its loopback-only environment: Ray
    # reads that setting on import, and a driver that imported it earlier reaches the
    # cluster through the machine's outward address (and hangs where that is not served).
    assert "ray" not in sys.modules
    from tools.localcluster import LocalCluster
    from trainer.data.blocks import PackedBlocks
    from trainer.data.cluster import tokenize_on_cluster
    from trainer.data.tokenize import prepare
    from trainer.model.loading import load_tokenizer

    tok = load_tokenizer(Path(model), None)
    # The cluster's processes import this checkout's trainer (Ray Data pickles the task
    # function by reference).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    with LocalCluster(num_cpus=0) as cluster:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_nodes(nodes + 1)
        import ray

        assert cluster.address.startswith("127.0.0.1:"), cluster.address
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            t0 = time.perf_counter()
            cache = prepare(
                corpus,
                tok,
                cache_root=f"{workdir}/raylift-cache",
                progress=False,
                tokenize_shards=tokenize_on_cluster,
            )
            seconds = time.perf_counter() - t0
        finally:
            ray.shutdown()
    return len(PackedBlocks(cache, block)) * block, seconds


def _one_thread() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its thread pool


def _tokenize_files(model: str, files: list[str], folder: str) -> int:
    from trainer.data.sources import list_sources
    from trainer.data.tokenize import Settings, tokenize_file
    from trainer.model.loading import load_tokenizer

    tok = load_tokenizer(Path(model), None)
    tokens = 0
    for name in files:
        (src,) = list_sources(name)
        stats = tokenize_file(src, Path(name).stem, Path(folder), tok, Settings(), overlap=False)
        tokens += stats.tokens
    return tokens


def on_processes(model: str, corpus: str, block: int, workdir: str, n: int) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    files = sorted(str(p) for p in Path(corpus).iterdir() if p.is_file())
    parts = [files[i::n] for i in range(n)]
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, as Ray's workers are
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_one_thread) as pool:
        counts = pool.map(_tokenize_files, [model] * n, parts, [workdir] * n)
        return sum(counts) // block * block  # whole blocks, as PackedBlocks counts them


def hf(model: str, corpus: str, block: int, workdir: str, num_proc: int | None) -> int:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ds = load_dataset(
        "json", data_files=corpus, split="train", cache_dir=f"{workdir}/hf-cache-{num_proc}"
    )

    def tokenize(batch):
        out = tok(batch["text"])
        out["input_ids"] = [[*ids, tok.eos_token_id] for ids in out["input_ids"]]
        return {"input_ids": out["input_ids"]}

    def group_texts(batch):
        flat = list(chain.from_iterable(batch["input_ids"]))
        total = (len(flat) // block) * block
        return {"input_ids": [flat[i : i + block] for i in range(0, total, block)]}

    # No reuse of an earlier run's cache: each measurement tokenizes for real.
    ds = ds.map(
        tokenize,
        batched=True,
        remove_columns=ds.column_names,
        num_proc=num_proc,
        load_from_cache_file=False,
    )
    ds = ds.map(group_texts, batched=True, num_proc=num_proc, load_from_cache_file=False)
    return len(ds) * block


def main() -> None:
    kind, model, corpus, block, workdir, out = sys.argv[1:7]
    t0 = time.perf_counter()
    seconds = None
    if kind == "raylift":
        tokens = raylift(model, corpus, int(block), workdir)
    elif kind == "reads":
        tokens = reads(model, corpus, int(block), workdir)
    elif kind.startswith("procs"):
        tokens = on_processes(model, corpus, int(block), workdir, int(kind[5:]))
    elif kind.startswith("ray"):
        tokens, seconds = on_ray(model, corpus, int(block), workdir, int(kind[3:]))
    else:  # "hf" is run_clm's default (one process), "hf2" uses both cores
        tokens = hf(model, corpus, int(block), workdir, 2 if kind == "hf2" else None)
    seconds = seconds or time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    Path(out).write_text(
        json.dumps(
            {
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "peak_rss_mb": max(peak, children),
            }
        )
    )


if __name__ == "__main__":
    main()
