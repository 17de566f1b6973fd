"""Every strategy and adapter through the production path: real Ray Train runs on the local
cluster (2 CPU workers, gloo, tiny Llama). One combined run per strategy where possible:
a worker is killed part way, Ray Train restarts the group, it resumes and finishes; then
the export is checked with plain transformers / peft."""

from __future__ import annotations

import gc
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ray_jobs import history, retrained, run_killed, run_to_end
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.preflight import run_all
from trainer.resilience import journal
from trainer.storage.location import resolve

pytestmark = pytest.mark.slow

LOSS_TOL = 1e-4
"""FSDP vs DDP, same seed and data: the reductions run in a different order (reduce-scatter
vs all-reduce, and a different world size after the 1-worker resume), so we allow 1e-4
absolute per step; measured differences are below 1e-5."""


def _losses(steps: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in steps]


def _probe_logits(model: Any, run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    probe = json.loads((run_dir / "final_probe.json").read_text())
    with torch.no_grad():
        got = model(input_ids=torch.tensor(probe["input_ids"])).logits
    return got, torch.tensor(probe["logits"])


def _lowered(steps: list[dict[str, Any]], by: float) -> None:
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - by, (first, last)


# ------------------------------------------------------------------ FSDP vs DDP gradients


def _grad_worker(rank: int, world: int, init: str, model_dir: str, tokens: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.config import JobConfig
    from trainer.model.loading import load_tokenizer
    from trainer.strategies.base import ModelSource, build_strategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    tok = load_tokenizer(Path(model_dir), tokens)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    x = torch.randint(0, len(tok), (2, 16), generator=gen)
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name in ("ddp", "fsdp"):
        cfg = JobConfig.model_validate(
            {
                "model": {"path": model_dir},
                "data": {"train_file": "unused.jsonl"},
                "strategy": {"name": name},
                "scaling": {"num_workers": world},
                "run": {"name": "grads"},
            }
        )
        s = build_strategy(cfg, torch.device("cpu"), rank, world)
        s.setup(ModelSource(Path(model_dir), len(tok)))
        with s.accumulating(True):
            s.backward(s.model(input_ids=x, labels=x).loss)
        module = getattr(s.model, "module", s.model)
        grads[name] = {}
        for n, p in module.named_parameters():
            g = p.grad
            grads[name][n] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach()
    if rank == 0:
        diff = {n: float((grads["ddp"][n] - g).abs().max()) for n, g in grads["fsdp"].items()}
        Path(out).write_text(json.dumps({"diff": diff, "names": sorted(grads["ddp"])}))
    # The strategies' DDP reducer and FSDP hooks go before their group: left to interpreter
    # exit, a reducer destroyed after the group aborted a rank ("terminate called without an
    # active exception") in one CI run in three.
    dist.barrier()
    del s, module
    gc.collect()
    dist.destroy_process_group()


def test_fsdp_gradients_equal_ddp_on_one_batch(tiny, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "grads.json"
    init = tempfile.mktemp(prefix="pg-", dir=tmp_path)
    mp.spawn(
        _grad_worker,
        args=(2, init, str(tiny["model"]), str(tiny["tokens"]), str(out)),
        nprocs=2,
        join=True,
    )
    result = json.loads(out.read_text())
    assert sorted(result["diff"]) == result["names"]  # every parameter has a gradient
    worst = max(result["diff"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, worst


# ------------------------------------------------------------------ FSDP


@pytest.fixture(scope="module")
def ddp_losses(ddp_reference):
    """The loss curve of the shared straight 12-step DDP run: every full-weight strategy
    trained from the same seed on the same data must reproduce it."""
    return _losses(history(ddp_reference["cfg"])[1])


KILL_AT = 8
"""The kill drill's step: the last rank SIGKILLs itself once every rank has reported step
8's checkpoint (every 4 steps; uploaded synchronously, so it is complete). Ray Train
restarts the worker group in the same job, and it resumes from 8."""


def _run_killed(ray_cluster, path, overrides=(), at=KILL_AT):
    """One Ray job whose last rank is SIGKILLed after step `at` (by default KILL_AT, right
    after its checkpoint, uploaded synchronously so complete); Ray Train restarts the group
    and it resumes from the newest checkpoint."""
    return run_killed(ray_cluster, path, at, ["checkpoint.upload=sync", *overrides])


def _stop_resume_export(ray_cluster, path, reference, resume_overrides=(), how="kill"):
    """how="kill": one Ray job whose worker is SIGKILLed after step 8 and that Ray restarts
    from the step-8 checkpoint (a restart inside a job costs a new worker group, not a new
    job). how="stop": stop at step 6, then resume to 12 in a fresh submission (with
    `resume_overrides`). Then check the lineage, the loss curve against the reference,
    and that the export reproduces the trained logits."""
    from transformers import AutoModelForCausalLM

    if how == "stop":
        run_to_end(ray_cluster, path, ["train.stop_at_step=6"])
        cfg, summary, _ = run_to_end(ray_cluster, path, list(resume_overrides))
    else:
        cfg, summary, _ = _run_killed(ray_cluster, path, resume_overrides)
    records, steps, wasted = history(cfg)
    resumes = [r["from_step"] for r in records if r.get("event") == "resume"]
    assert resumes == ([6] if how == "stop" else [KILL_AT])
    if how == "kill":
        records = journal.read(resolve(str(Path(cfg.storage.path) / cfg.run.name)))
        assert [r["cause"] for r in records if r["event"] == "failure"] == ["worker_died"]
    assert [r["step"] for r in steps] == list(range(1, 13)) and wasted == 0
    for step, (want, got) in enumerate(zip(reference, _losses(steps), strict=True), start=1):
        assert got == pytest.approx(want, abs=LOSS_TOL), step
    _lowered(steps, 0.5)
    run_dir = Path(cfg.storage.path) / cfg.run.name
    model = AutoModelForCausalLM.from_pretrained(Path(summary["export"]) / "model")
    assert model.config.architectures == ["LlamaForCausalLM"]
    got, want = _probe_logits(model, run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return cfg, run_dir


def test_fsdp_matches_ddp_resumes_on_one_worker_and_exports(ray_cluster, job, ddp_losses):
    """FSDP from the same seed agrees with DDP step by step. Through Ray Train it trains
    steps 1-6 with tensor parallelism (tp=2 over both workers, one replica: grad_accum 2
    keeps DDP's global batch of 8), then resumes as plain FSDP on one worker (dcp/2 loads
    on another layout and world size); its gathered export reproduces the trained
    model's logits with plain transformers."""
    path = job("fsdp", strategy={"name": "fsdp", "tp": 2}, train={"grad_accum": 2})
    _, run_dir = _stop_resume_export(
        ray_cluster, path, ddp_losses, ["scaling.num_workers=1", "strategy.tp=1"], "stop"
    )
    state = json.loads((run_dir / "step_00000012" / "trainer_state.json").read_text())
    assert (state["strategy"], state["layout"], state["world_size"]) == ("fsdp", "dcp/2", 1)
    assert (run_dir / "step_00000008" / "strategy" / "dcp2" / ".metadata").exists()
    # (The same run name under another strategy is refused, naming both: unit-tested in
    # tests/unit/test_checkpoint.py; a job error reaching the user is test_ray_train's.)


TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "ray_template"
"""DeepSpeed files shaped like the Ray Llama-2 template's: ZeRO-3, "auto" everywhere, no
optimizer section (the template builds its optimizer in code); the 7B one offloads
optimizer and parameters to CPU, the 70B one the optimizer to NVMe."""


# ZeRO-3 with CPU offload (the Ray template's JSON) runs in make bench (bench_only, issue 56).
@pytest.mark.parametrize(
    "config",
    ["zero2", pytest.param("template_zero3_cpu_offload", marks=pytest.mark.bench_only)],
)
def test_deepspeed_kill_resume_export(ray_cluster, job, ddp_losses, config, request):
    """ZeRO-2 from the shipped stock JSON file, and ZeRO-3 from the Ray template's own
    ZeRO-3 + CPU offload file as users have it (no optimizer section, so Raylift builds
    DeepSpeed's C++ CPU Adam, JIT-built once per CI run by the `ds_cpu_adam` fixture):
    same curve as DDP, a worker SIGKILLed after step 8 and the group resumed exactly
    from DeepSpeed's own checkpoint, and a gathered 16-bit export that reproduces the
    logits with plain transformers. (The stock ZeRO-3 file, with and without offload,
    trains, stops, resumes and exports in the CPU self-check, test_gpucheck_cpu.py: one
    Ray job fewer here, ~70 s of CI.)"""
    source = config
    if config.startswith("template_"):
        request.getfixturevalue("ds_cpu_adam")
        source = str(TEMPLATE / "zero_3_llama_2_7b.json")
    path = job(f"ds-{config}", strategy={"name": "deepspeed", "config": source})
    _, run_dir = _stop_resume_export(ray_cluster, path, ddp_losses)
    state = json.loads((run_dir / "step_00000012" / "trainer_state.json").read_text())
    assert (state["strategy"], state["layout"]) == ("deepspeed", "deepspeed/1")
    assert (run_dir / "step_00000012" / "strategy" / "ds" / "state").is_dir()
    assert not (run_dir / "step_00000012" / "strategy" / "adapter.pt").exists()
    # DeepSpeed's checkpoint loads only on the world size that wrote it: resubmitting the
    # run on one worker is refused at preflight, in one line, before any worker starts.
    with pytest.raises(ConfigError) as exc:
        run_all(load_config(path, ["scaling.num_workers=1", "train.grad_accum=2"]))
    msg = str(exc.value)
    assert "\n" not in msg and "step_00000012" in msg, msg
    assert "written by 2 workers" in msg and "scaling.num_workers: 2" in msg, msg
    run_all(load_config(path))  # the same two workers resume
    if config.startswith("template_"):
        # The offloaded optimizer state is CPU Adam's (fp32 moments for every parameter).
        optim = list((run_dir / "step_00000012" / "strategy" / "ds" / "state").glob("*optim*"))
        assert len(optim) == 2, optim  # one partition per rank


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_template_nvme_offload_is_refused_before_any_worker_starts(ray_cluster, job, capsys):
    """The template's 70B file offloads the optimizer to /mnt/local_storage/zero. Where
    the worker nodes lack that folder (or DeepSpeed's async_io op, which needs libaio),
    the driver refuses the job in one line, naming the file, the key and the fix, before
    tokenizing or starting a worker."""
    from tools import submit

    source = TEMPLATE / "zero_3_llama_2_70b.json"
    assert not Path("/mnt/local_storage/zero").exists()
    path = job("ds-nvme", strategy={"name": "deepspeed", "config": str(source)})
    argv = [str(path), "--address", ray_cluster.dashboard_url, "--no-progress"]
    assert submit.main(argv) == 1
    out = capsys.readouterr()
    tail = [x for x in out.err.splitlines() if x.startswith("  | ")]
    want = (
        f"{source}: on node 127.0.0.1: zero_optimization.offload_optimizer.nvme_path "
        "/mnt/local_storage/zero does not exist; create it on every worker node"
    )
    assert any(want in x for x in tail), out.err
    assert "Traceback" not in out.out + out.err
    assert not (path.parent / "runs" / "ds-nvme").exists()  # no worker ever started


# ------------------------------------------------------------------ LoRA / QLoRA


def _peft_model(run_dir: Path, export: Path, base: Path, quantized: bool) -> Any:
    """What a user does with the adapter folder: base model (+ the tokenizer's new rows),
    then PeftModel.from_pretrained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    kwargs: dict[str, Any] = {}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    tok = AutoTokenizer.from_pretrained(export / "adapter")
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    model.resize_token_embeddings(len(tok))
    return PeftModel.from_pretrained(model, export / "adapter").train()


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_lora_adapter_and_merged_exports_reproduce_logits(ray_cluster, job, tiny):
    """A run whose worker is killed after step 8 resumes from the adapter checkpoint (its
    exactness against a straight run is the QLoRA test's: the same adapter checkpoint code,
    plus quantization); the adapter folder on the base model and the merged export both
    reproduce the trained logits."""
    from transformers import AutoModelForCausalLM

    lora = {"adapter": "lora", "lora": {"merge_on_export": True}}
    # An MLflow server that is down for the whole run (nothing listens on its port): the
    # run trains, restarts and exports all the same, and says what it could not send.
    down = {"mlflow": {"tracking_uri": f"http://127.0.0.1:{_closed_port()}"}, "close_timeout_s": 3}
    path = job("lora", model=lora, optim={"lr": 1e-2}, tracking=down)
    cfg, summary, logs = _run_killed(ray_cluster, path)
    assert "tracker mlflow: open failed" in logs
    assert re.search(r"tracker mlflow: \d+ points not sent .* every one is in metrics.jsonl", logs)
    records, steps, wasted = history(cfg)
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [KILL_AT]
    assert [r["step"] for r in steps] == list(range(1, 13)) and wasted == 0
    _lowered(steps, 1.0)

    run_dir = Path(cfg.storage.path) / cfg.run.name
    export = Path(summary["export"])
    # Resume state holds only what trains (adapters + the grown embeddings), not the base.
    resume = torch.load(run_dir / "step_00000012" / "strategy" / "model.pt")
    assert resume and all("lora_" in k or "modules_to_save" in k for k in resume)
    got, want = _probe_logits(_peft_model(run_dir, export, tiny["model"], False).eval(), run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(export / "model_merged")
    got, want = _probe_logits(merged, run_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.bench_only  # issue 56: docs/development.md
def test_qlora_eval_mid_training_changes_nothing_and_resume_is_exact(ray_cluster, job, tiny):
    """bitsandbytes 0.50.2 rewrites Linear4bit weights in place when they run in eval mode
    on avx512_bf16 CPUs. The run evaluates every 2 steps and its last rank is killed after
    step 10; Ray restarts the group from the step-8 adapter checkpoint with the 4-bit base
    loaded afresh, and steps 9 and 10 are trained again. The first attempt trained them
    after four evaluations of its base, the second after none: their losses must be
    identical (an evaluation changed nothing, and the resume restored everything)."""
    qlora = {"adapter": "qlora"}
    optim = {"lr": 1e-2, "name": "adamw8bit"}
    db = Path(tempfile.mkdtemp(prefix="raylift-mlflow-")) / "mlflow.db"
    tracking = {
        "mlflow": {"tracking_uri": f"sqlite:///{db}", "experiment": "qlora"},
        "wandb": {"project": "raylift-test", "mode": "offline"},
        "tensorboard": True,
    }
    path = job("qlora", model=qlora, optim=optim, train={"eval_every": 2}, tracking=tracking)
    cfg, summary, _ = _run_killed(ray_cluster, path, at=10)
    records, steps, wasted = history(cfg)
    assert [r["from_step"] for r in records if r.get("event") == "resume"] == [KILL_AT]
    assert [r["step"] for r in steps] == list(range(1, 13)) and wasted == 2
    _trackers_hold_every_step_once(Path(cfg.storage.path) / cfg.run.name, f"sqlite:///{db}")
    assert [r["step"] for r in steps if "eval_loss" in r] == [2, 4, 6, 8, 10, 12]
    for step, (first, again) in zip((9, 10), retrained(records, [9, 10]), strict=True):
        assert again == pytest.approx(first, abs=1e-6), step
    _lowered(steps, 1.0)

    run_dir = Path(cfg.storage.path) / cfg.run.name
    model = _peft_model(run_dir, Path(summary["export"]), tiny["model"], True)
    got, want = _probe_logits(model, run_dir)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_qlora_build_keeps_4bit_layout_and_uses_nf4(tiny):
    """The switch that stops bitsandbytes' CPU repacking is set on every 4-bit layer, and
    the base really is nf4 with double quantization."""
    import bitsandbytes as bnb

    from trainer.config import JobConfig
    from trainer.model.loading import load_tokenizer
    from trainer.strategies.base import ModelSource, build_strategy

    cfg = JobConfig.model_validate(
        {
            "model": {"path": str(tiny["model"]), "adapter": "qlora"},
            "data": {"train_file": "unused.jsonl"},
            "optim": {"name": "adamw8bit"},
            "scaling": {"num_workers": 1},
            "run": {"name": "q"},
        }
    )
    tok = load_tokenizer(tiny["model"], str(tiny["tokens"]))
    s = build_strategy(cfg, torch.device("cpu"), 0, 1)
    s.setup(ModelSource(tiny["model"], len(tok)))
    layers = [m for m in s.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    qs = layers[0].weight.quant_state
    assert qs.quant_type == "nf4" and qs.nested
    assert isinstance(s.optimizer, bnb.optim.AdamW8bit)


# ------------------------------------------------------------------ oneCCL on Ray

_CCL_DRIVER = """
import json, os, sys
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from trainer.runtime.ccl import OneCCLConfig

def loop(config):
    import torch.distributed as dist, ray.train
    env = {k: os.environ.get(k) for k in ("FI_PROVIDER", "CCL_WORKER_COUNT", "CCL_LOCAL_RANK")}
    env["bindings_loaded"] = "ccl_probe_bindings" in sys.modules
    env["backend"] = dist.get_backend()
    env["world"] = dist.get_world_size()
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(env, f)

ray.init(address=os.environ["RAY_ADDRESS"])
out = sys.argv[1]
TorchTrainer(
    loop,
    train_loop_config={"out": out},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(name="ccl-path", storage_path=out),
    torch_config=OneCCLConfig(
        backend="gloo",
        bindings="ccl_probe_bindings",
        env={"FI_PROVIDER": "tcp", "CCL_WORKER_COUNT": "1"},
    ),
).fit()
"""


def test_ccl_backend_config_prepares_every_worker_before_the_process_group(ray_cluster, tmp_path):
    """The oneCCL BackendConfig through Ray Train with gloo substituted for ccl (torch 2.13
    has no oneCCL binding; the ccl image runs the real one): every worker has the CCL/FI
    environment and the bindings imported, and the process group comes up."""
    import sys
    import time

    from tools.jobcli.client import client_for

    (tmp_path / "ccl_probe_bindings.py").write_text("LOADED = True\n")
    (tmp_path / "driver.py").write_text(_CCL_DRIVER)
    client = client_for(ray_cluster.dashboard_url)
    repo = str(Path(__file__).resolve().parents[2])
    job_id = client.submit_job(
        entrypoint=f"{sys.executable} driver.py {tmp_path}",
        runtime_env={
            "working_dir": str(tmp_path),
            "env_vars": {"PYTHONPATH": f"{repo}:{tmp_path}"},
        },
    )
    deadline = time.monotonic() + 600
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert str(client.get_job_status(job_id)).endswith("SUCCEEDED"), client.get_job_logs(job_id)[
        -3000:
    ]
    for rank in (0, 1):
        env = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert env["FI_PROVIDER"] == "tcp" and env["CCL_WORKER_COUNT"] == "1"
        assert env["bindings_loaded"] and env["backend"] == "gloo" and env["world"] == 2
        assert env["CCL_LOCAL_RANK"] is not None


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _trackers_hold_every_step_once(run_dir: Path, mlflow_uri: str) -> None:
    """The QLoRA run trained 1-10, lost 9-10 to the kill and trained 9-12 again: one
    tracker run per tracker, holding steps 1-12 once each (TensorBoard by purging)."""
    from mlflow.tracking import MlflowClient

    from tests.support.trackers import tb_events, wandb_history

    ids = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("qlora").experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(ids["mlflow"], "loss"))
    assert steps == list(range(1, 13)), steps
    evals = sorted(m.step for m in client.get_metric_history(ids["mlflow"], "eval_loss"))
    assert evals == [2, 4, 6, 8, 10, 12]
    assert {m.step for m in client.get_metric_history(ids["mlflow"], "mem_reserved_gib_max")} == (
        set(range(1, 13))
    )
    assert run.data.params["model.adapter"] == "qlora" and run.data.params["run.name"] == "qlora"
    assert run.data.tags["raylift.export"] == str(run_dir / "export" / "step_00000012")
    events = [json.loads(v) for k, v in run.data.tags.items() if k.startswith("raylift.event.")]
    attempts = [e for e in events if e["event"] == "attempt"]
    assert [(a["from_step"], a["lost_steps"]) for a in attempts] == [(0, 0), (8, 2)]

    tb = tb_events(run_dir / "tensorboard")
    assert sorted(n.rsplit(".", 1)[1] for n in tb) == ["attempt-1", "attempt-2"]
    by_attempt = {n.rsplit(".", 1)[1]: evs for n, evs in tb.items()}

    def tb_steps(events):
        return [e.step for e in events for v in e.summary.value if v.tag == "loss"]

    assert tb_steps(by_attempt["attempt-1"]) == list(range(1, 11))
    second = by_attempt["attempt-2"]
    assert tb_steps(second) == [9, 10, 11, 12]
    purge = [e.step for e in second if e.HasField("session_log")]
    assert purge[:1] == [9]  # TensorBoard drops attempt 1's 9 and 10

    # Offline W&B: a folder per attempt, one run id. Attempt 1's folder holds what W&B
    # wrote before the kill (its writes are batched: on this loaded 2-core machine the
    # kill can come before the first batch); attempt 2's, closed cleanly, 9 to 12.
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(ids["wandb"]) for f in folders), folders
    first = [int(r["_step"]) for r in wandb_history(folders[0])]
    assert first == list(range(1, len(first) + 1)) and len(first) <= 10, first
    assert [int(r["_step"]) for r in wandb_history(folders[1])] == [9, 10, 11, 12]
