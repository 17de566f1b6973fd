"""LoRA and QLoRA on the sharded strategies (FSDP2, ZeRO-3), against the same adapter on
DDP. Two process-group checks on 2 gloo ranks (every strategy from one seed on the same
batches; QLoRA's load never holding the whole base), then real Ray Train runs on the
local cluster: a kill and an exact resume, a resume on another world size, and exports
that plain peft loads to the trained model's logits."""

from __future__ import annotations

import gc
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.jobs import write_job
from tests.support.ray_jobs import history, retrained, run_killed, run_to_end

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-4
"""Per-step loss against DDP: reduce-scatter vs all-reduce (and another world size after a
resume) reorder the sums; measured differences are below 1e-5."""
STEPS = 20
KILL_AT = 12


# ------------------------------------------------------------------ one process group


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(model_dir: str, strategy: str, adapter: str, world: int, **lora: Any) -> Any:
    from trainer.config import JobConfig

    spec = {"name": "deepspeed", "config": "zero3"} if strategy == "zero3" else {"name": strategy}
    return JobConfig.model_validate(
        {
            "model": {"path": model_dir, "adapter": adapter, "lora": lora},
            "data": {"train_file": "unused.jsonl"},
            "strategy": spec,
            "optim": {"lr": 1e-2},
            "scaling": {"num_workers": world},
            "run": {"name": "adapters"},
        }
    )


def _dequantized_base(model: torch.nn.Module) -> None:
    """Every frozen Linear but the output head replaced by its NF4 round trip: the
    unsharded QLoRA model, in full precision, that FSDP2's sharded NF4 base must compute
    exactly."""
    from torchao.quantization import to_nf4

    from trainer.model.nf4 import block_sizes

    with torch.no_grad():
        for name, m in model.named_modules():
            # (A peft model loaded for inference has frozen adapters too.)
            if type(m) is not torch.nn.Linear or "lm_head" in name or "lora_" in name:
                continue
            if m.weight.requires_grad:
                continue
            w = m.weight
            w.copy_(to_nf4(w.detach().clone(), *block_sizes(*w.shape)).get_original_weight())


def _env(rank: int, world: int) -> None:
    # What Ray Train and torchrun set, and ZeRO-3's partitioned init reads.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)


RUNS = {
    "ddp-lora": ("ddp", "lora"),
    "fsdp-lora": ("fsdp", "lora"),
    "ddp-nf4-lora": ("ddp", "lora"),
    "fsdp-qlora": ("fsdp", "qlora"),
    # Last: ZeRO-3's partitioned init leaves torch's F.linear patched in this process.
    "zero3-lora": ("zero3", "lora"),
}


def _strategies_worker(
    rank: int, world: int, init: str, model_dir: str, tokens: str, out: str, runs: list[str]
):
    import torch.distributed as dist

    from trainer.model.loading import load_tokenizer
    from trainer.model.nf4 import is_nf4
    from trainer.strategies.base import ModelSource, build_strategy

    _env(rank, world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    tok = load_tokenizer(Path(model_dir), tokens)
    result: dict[str, Any] = {"losses": {}}
    for run in runs:
        name, adapter = RUNS[run]
        s = build_strategy(
            _config(model_dir, name, adapter, world), torch.device("cpu"), rank, world
        )
        s.setup(ModelSource(Path(model_dir), len(tok)))
        if run == "ddp-nf4-lora":
            _dequantized_base(s.hf)
        if run == "fsdp-qlora":
            nf4 = [(n, p) for n, p in s.model.named_parameters() if is_nf4(p)]
            result["nf4"] = {
                n: [
                    list(p.shape),
                    list(getattr(p, "to_local", lambda p=p: p)().shape),
                    p.requires_grad,
                ]
                for n, p in nf4
            }
            result["trainable"] = sorted(
                n for n, p in s.model.named_parameters() if p.requires_grad
            )
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
        x = torch.randint(0, len(tok), (2, 16), generator=gen)
        losses = []
        for _ in range(5):
            with s.accumulating(True):
                loss = s.train_micro(x, x, None)
            s.step()
            losses.append(float(loss))
        result["losses"][run] = losses
        dist.barrier()
        del s
        gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(worker: Any, *args: Any, world: int = 2) -> None:
    import torch.multiprocessing as mp

    init = tempfile.mktemp(prefix="pg-")
    mp.spawn(worker, args=(world, init, *args), nprocs=world, join=True)


def test_every_strategy_trains_the_same_adapter_as_ddp(tiny, tmp_path):
    """From one seed on the same per-rank batch, five steps: LoRA on FSDP2 and on ZeRO-3 takes DDP's
    steps, and QLoRA on FSDP2 (the base sharded in NF4: each rank holds half the rows of
    every 4-bit weight, none of them trainable) takes the steps of the unsharded model
    whose base is the same NF4 weights, dequantized."""
    out = tmp_path / "out.json"
    _spawn(_strategies_worker, str(tiny["model"]), str(tiny["tokens"]), str(out), list(RUNS))
    result = json.loads(out.read_text())
    losses = result["losses"]
    for run, ref in (
        ("fsdp-lora", "ddp-lora"),
        ("zero3-lora", "ddp-lora"),
        ("fsdp-qlora", "ddp-nf4-lora"),
    ):
        assert losses[run] == pytest.approx(losses[ref], abs=1e-5), run
    assert losses["fsdp-qlora"] != pytest.approx(losses["fsdp-lora"], abs=1e-5)  # it is 4-bit
    assert losses["ddp-lora"][-1] < losses["ddp-lora"][0]
    nf4 = result["nf4"]
    assert len(nf4) == 7 * 2  # every linear of both layers, adapted (q, k, v, o) or not
    for name, (full, local, trainable) in nf4.items():
        assert name.endswith(".weight") and "lm_head" not in name and not trainable
        assert local == [full[0] // 2, full[1]], name
    assert result["trainable"] and all(
        "lora_" in n or "modules_to_save" in n for n in result["trainable"]
    )


def test_qlora_on_one_fsdp_rank_trains_the_unsharded_model(tiny, tmp_path):
    """One rank (a resume on one worker, a single-GPU job): the NF4 weights are not
    sharded (FSDP2 in torch 2.13 mishandles a one-rank group's NF4 all-gather), and the
    steps are those of the same model on DDP."""
    out = tmp_path / "out.json"
    runs = ["ddp-nf4-lora", "fsdp-qlora"]
    _spawn(_strategies_worker, str(tiny["model"]), str(tiny["tokens"]), str(out), runs, world=1)
    result = json.loads(out.read_text())
    losses = result["losses"]
    assert losses["fsdp-qlora"] == pytest.approx(losses["ddp-nf4-lora"], abs=1e-5)
    assert len(result["nf4"]) == 7 * 2
    assert all(full == local for full, local, _ in result["nf4"].values())


def _anon_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _load_worker(rank: int, world: int, init: str, model_dir: str, out: str):
    import torch.distributed as dist

    from trainer.strategies.base import ModelSource, build_strategy

    _env(rank, world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cfg = _config(model_dir, "fsdp", "qlora", world, target_modules=ALL_LINEAR)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    s = build_strategy(cfg, torch.device("cpu"), rank, world)
    # The libraries setup imports, loaded before the baseline: their code is not the base.
    import accelerate  # noqa: F401
    import peft  # noqa: F401
    import torchao.quantization  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    # torchao quantizes a weight in chunks of 1 M values with a 16-wide distance matrix
    # each: ~130 MB of scratch whatever the model's size. Smaller chunks here, so that
    # what the peak measures is what grows with the model.
    nf4_tensor.CHUNK_SIZE = 1 << 16

    base, peak, done = _anon_rss(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anon_rss())
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    s.setup(ModelSource(Path(model_dir), vocab))
    done.set()
    watcher.join()
    peak[0] = max(peak[0], _anon_rss())
    held = s.state_nbytes()["params"]
    Path(f"{out}.{rank}").write_text(
        json.dumps({"peak": peak[0] - base, "params": held, **s.nf4_load})
    )
    dist.barrier()
    del s
    gc.collect()
    dist.destroy_process_group()


def test_qlora_fsdp_load_never_holds_the_whole_base(tmp_path, monkeypatch):
    """A 75M-parameter Llama (300 MB in fp32; its linear layers, 38 MB in NF4) loaded as
    QLoRA on FSDP2 over 2 ranks: each rank ends up holding half of the 4-bit base (and of
    the rest), the largest full-precision tensor it ever held at once is one weight (read
    from the memory-mapped file, quantized, cut, dropped), and its anonymous memory never
    grew by a third of the full-precision base (what `from_pretrained` with a
    bitsandbytes config adds on every rank). The peak also holds one weight's quantization
    scratch, as large as the 4-bit base at this size, so it cannot tell "half the 4-bit
    base" from "all of it"; the held bytes do. glibc keeps freed multi-MB buffers in its
    heap unless told to give them back; with a fixed mmap threshold, as here, RSS is what
    is alive."""
    from tools.tiny import build_model

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # read by each spawned rank
    hidden, inter, layers, vocab = 1024, 2048, 8, 512
    model_dir = build_model(tmp_path / "model", vocab, hidden=hidden, layers=layers, heads=8)
    out = tmp_path / "load"
    _spawn(_load_worker, str(model_dir), str(out))
    linear = layers * (hidden * hidden * 3 + 3 * hidden * inter)  # q, o, k+v (half), mlp
    whole_nf4 = linear / 2 * 1.02  # 4 bits a value, plus block scales
    rest = 2 * vocab * hidden * 4 + layers * 16 * 8192 * 4  # embeddings, head; adapters
    for rank in (0, 1):
        r = json.loads(Path(f"{out}.{rank}").read_text())
        assert r["largest_full_weight"] == hidden * inter * 4  # one MLP weight, fp32
        assert r["params"] < 0.55 * (whole_nf4 + rest), r
        assert r["peak"] < linear * 4 / 3, r


# ------------------------------------------------------------------ on Ray Train


def _losses(steps: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in steps]


def _adapter_job(root: Path, tiny: dict[str, Path], name: str, **sections: Any) -> Path:
    """The shared base job, 20 steps, a global batch of 8 whatever the world size (so a
    resume on one worker accumulates 2 micro batches), adapters on every strategy."""
    merged: dict[str, dict[str, Any]] = {
        "train": {"max_steps": STEPS, "global_batch_size": 8},
        "optim": {"lr": 1e-2},
        "model": {"adapter": "lora"},
    }
    for section, values in sections.items():
        merged[section] = {**merged.get(section, {}), **values}
    return write_job(tiny, root, name, **merged)


@pytest.fixture(scope="module")
def ddp_lora(tiny, tmp_path_factory):
    """The reference: LoRA on DDP, 20 straight steps. Under torchrun: the same loop, world
    size and gloo reductions as on Ray Train, without a Ray job's start-up (~45 s on the CI
    machine); LoRA on DDP through Ray Train is test_strategies' adapter test."""
    from tests.support.torchrun import torchrun
    from tools.jobcli import submit
    from trainer.config import load_config

    root = tmp_path_factory.mktemp("ddp-lora")
    path = _adapter_job(root, tiny, "ddp-lora")
    res = torchrun(["-m", "trainer", "run", str(path)])
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = submit.absolutize(load_config(path, []), Path.cwd())
    return _losses(history(cfg)[1])


def _probe(model: Any, run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    probe = json.loads((run_dir / "final_probe.json").read_text())
    with torch.no_grad():
        got = model(input_ids=torch.tensor(probe["input_ids"])).logits
    return got, torch.tensor(probe["logits"])


def _peft_model(export: Path, base: Path, nf4: bool) -> Any:
    """What a user does with the adapter folder: the base model (+ the tokenizer's new
    rows), then PeftModel.from_pretrained; for QLoRA on FSDP2, the base's adapted weights
    are quantized to NF4 as training saw them (here dequantized back: the same values)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export / "adapter")
    model = AutoModelForCausalLM.from_pretrained(base)
    model.resize_token_embeddings(len(tok))
    model = PeftModel.from_pretrained(model, export / "adapter").eval()
    if nf4:
        _dequantized_base(model)
    return model


def _check_run(cfg: Any, ref: list[float] | None, resumed_from: int | list[int]) -> Path:
    records, steps, _ = history(cfg)
    want = [resumed_from] if isinstance(resumed_from, int) else resumed_from
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == want
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    if ref is not None:
        for step, (want, got) in enumerate(zip(ref, _losses(steps), strict=True), start=1):
            assert got == pytest.approx(want, abs=LOSS_TOL), step
    first, last = _losses(steps)[:3], _losses(steps)[-3:]
    assert sum(last) / 3 < sum(first) / 3 - 1.0
    return Path(cfg.storage.path) / cfg.run.name


def _trainable_only(dcp_dir: Path) -> list[str]:
    """The model keys of a DCP resume state (none of the frozen base's)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    model = [k for k in keys if k.startswith("model.")]
    assert model and all("lora_" in k or "modules_to_save" in k for k in model), model[:5]
    return model


def _torchrun_job(path: Path, nproc: int, *overrides: str) -> tuple[Any, dict[str, Any]]:
    """`python -m trainer run` under torchrun on `nproc` ranks: (the config, the summary)."""
    from tests.support.torchrun import torchrun
    from tools.jobcli import submit
    from trainer.config import load_config
    from trainer.observability.logs import SUMMARY_MARK, find_marked

    args = ["-m", "trainer", "run", str(path)]
    for o in overrides:
        args += ["--set", o]
    res = torchrun(args, nproc=nproc)
    assert res.returncode == 0, res.stderr[-3000:]
    found = (find_marked(line, SUMMARY_MARK)[0] for line in res.stdout.splitlines())
    summary = next(s for s in found if s is not None)
    return submit.absolutize(load_config(path, list(overrides)), Path.cwd()), summary


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_fsdp_lora_matches_ddp_resumes_on_one_worker_and_exports(tiny, tmp_path, ddp_lora):
    """LoRA on FSDP2 takes DDP's 20 steps: 2 workers to step 8, then a fresh run on one
    worker resumes from the adapter-only dcp/2 state (DCP reshards it); the adapter folder
    on the plain base and the merged export reproduce the trained logits. Under torchrun
    (issue 56): the same loop and gloo reductions without two Ray jobs' start-up; FSDP2
    stopped on Ray and resumed there on one worker is test_strategies' FSDP test, and
    sharded adapters killed and restarted by Ray Train are the tests below."""
    from transformers import AutoModelForCausalLM

    path = _adapter_job(
        tmp_path,
        tiny,
        "fsdp-lora",
        strategy={"name": "fsdp"},
        model={"lora": {"merge_on_export": True}},
    )
    _torchrun_job(path, 2, "train.stop_at_step=8")
    cfg, summary = _torchrun_job(path, 1, "scaling.num_workers=1")
    run_dir = _check_run(cfg, ddp_lora, 8)
    _trainable_only(run_dir / f"step_{STEPS:08d}" / "strategy" / "dcp2")
    export = Path(summary["export"])
    got, want = _probe(_peft_model(export, tiny["model"], nf4=False), run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got, want = _probe(AutoModelForCausalLM.from_pretrained(export / "model_merged"), run_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert json.loads((export / "checks.json").read_text())["checks"][0]["passed"]  # FSDP2 merge


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_fsdp_qlora_resumes_exactly_after_a_kill_and_exports(ray_cluster, tiny, tmp_path):
    """QLoRA on FSDP2 (NF4 base, sharded): the last rank is SIGKILLed after step 14, Ray
    restarts the group from step 12's adapter checkpoint with the base quantized afresh,
    and steps 13 and 14 come out identical; the adapter folder, on the base quantized
    the same way, reproduces the trained logits."""
    path = _adapter_job(
        tmp_path, tiny, "fsdp-qlora", strategy={"name": "fsdp"}, model={"adapter": "qlora"}
    )
    cfg, summary, _ = run_killed(ray_cluster, path, 14, ["checkpoint.upload=sync"])
    run_dir = _check_run(cfg, None, 12)
    records, _, _ = history(cfg)
    for step, (first, again) in zip((13, 14), retrained(records, [13, 14]), strict=True):
        assert again == pytest.approx(first, abs=1e-6), step
    _trainable_only(run_dir / f"step_{STEPS:08d}" / "strategy" / "dcp2")
    got, want = _probe(_peft_model(Path(summary["export"]), tiny["model"], nf4=True), run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


ZERO3_STOP = 16
"""The shared ZeRO-3 run stops here on 2 workers (after the kill's restart from KILL_AT)
and a fresh submission on one worker takes it to STEPS."""


@pytest.fixture(scope="module")
def zero3_lora(ray_cluster, tiny, tmp_path_factory) -> tuple[Any, dict[str, Any]]:
    """LoRA on ZeRO-3 (the shipped zero3 file), one run for both ZeRO-3 tests below (issue
    56: one Ray job fewer than a run each): on 2 workers the last rank is SIGKILLed after
    step 12 and Ray Train restarts the group from that checkpoint, which stops at step 16;
    a fresh submission on one worker then resumes from 16 and finishes step 20."""
    root = tmp_path_factory.mktemp("zero3-lora")
    strategy = {"name": "deepspeed", "config": "zero3"}
    path = _adapter_job(root, tiny, "zero3-lora", strategy=strategy)
    overrides = ["checkpoint.upload=sync", f"train.stop_at_step={ZERO3_STOP}"]
    run_killed(ray_cluster, path, KILL_AT, overrides)
    cfg, summary, _ = run_to_end(ray_cluster, path, ["scaling.num_workers=1"])
    return cfg, summary


def test_zero3_lora_matches_ddp_after_a_kill_and_exports(zero3_lora, tiny, ddp_lora):
    """LoRA on ZeRO-3 (the shipped zero3 file): DDP's 20 steps, through a SIGKILL after
    step 12 and DeepSpeed's resume of its trainable-only checkpoint; the gathered adapter
    folder reproduces the trained logits on the plain base. (The shared run's later
    resume on one worker, from 16, is the next test's.)"""
    cfg, summary = zero3_lora
    run_dir = _check_run(cfg, ddp_lora, [KILL_AT, ZERO3_STOP])
    ds = run_dir / f"step_{STEPS:08d}" / "strategy" / "ds" / "state"
    states = torch.load(ds / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    module = states["module"]  # the checkpoint's weights: the trainable ones only
    assert module and all("lora_" in k or "modules_to_save" in k for k in module), list(module)
    got, want = _probe(_peft_model(Path(summary["export"]), tiny["model"], nf4=False), run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Growing (ZeRO-2, 1 to 2) runs in make bench (bench_only, issue 56): the portable
# adapter.pt that lets a world size change is the same file either way, and CI shrinks.
@pytest.mark.parametrize(
    ("config", "first", "then"),
    [("zero3", 2, 1), pytest.param("zero2", 1, 2, marks=pytest.mark.bench_only)],
)
def test_deepspeed_lora_resumes_on_another_world_size(
    ray_cluster, tiny, tmp_path, ddp_lora, config, first, then, request
):
    """DeepSpeed's own folder loads only on the world size that wrote it; an adapter's
    checkpoint also holds what trains whole (`adapter.pt`), so LoRA on ZeRO-3 shrinks from
    2 workers to 1 (at step 16 of the ZeRO-3 run shared with the kill test above), and on
    ZeRO-2 grows from 1 to 2 at step 8, on DDP's curve; the adapter folder then
    reproduces the trained logits on the plain base."""
    if config == "zero3":
        cfg, summary = request.getfixturevalue("zero3_lora")
        resumes = [KILL_AT, ZERO3_STOP]  # the kill's restart on 2 workers, then one worker
    else:
        strategy = {"name": "deepspeed", "config": config}
        path = _adapter_job(tmp_path, tiny, f"{config}-lora-{first}to{then}", strategy=strategy)
        run_to_end(ray_cluster, path, ["train.stop_at_step=8", f"scaling.num_workers={first}"])
        cfg, summary, _ = run_to_end(ray_cluster, path, [f"scaling.num_workers={then}"])
        resumes = [8]
    run_dir = _check_run(cfg, ddp_lora, resumes)
    starts = [r["world_size"] for r in history(cfg)[0] if r.get("event") == "start"]
    assert starts[0] == first and starts[-1] == then, starts
    portable = torch.load(run_dir / f"step_{STEPS:08d}" / "strategy" / "adapter.pt")
    assert portable["optimizer_step"] == STEPS, portable["optimizer_step"]
    names = sorted(portable["tensors"])
    assert names and all("lora_" in n or "modules_to_save" in n for n in names), names
    got, want = _probe(_peft_model(Path(summary["export"]), tiny["model"], nf4=False), run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
