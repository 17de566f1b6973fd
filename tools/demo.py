"""`make demo`: the production path, end to end, on this machine.

Builds a tiny Llama and a tokenizer trained here, generates a GSM8K-shaped dataset in the
Ray Llama template's format, starts a local Ray cluster on 127.0.0.1, submits the job
through the Jobs API exactly as `tools/submit.py` does against a real cluster, follows it,
plots the loss, and stops the cluster it started.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from tools import report, tiny
from tools.jobcli import follow, submit
from tools.localcluster import LocalCluster
from trainer.config import load_config
from trainer.preflight import run_all

ROOT = Path(__file__).resolve().parents[1]

JOB = """\
model:
  path: {assets}/model
  special_tokens: {assets}/data/tokens.json
data:
  train_file: {assets}/data/train.jsonl
  eval_file: {assets}/data/eval.jsonl
  block_size: 64
train:
  micro_batch_size: 8
  epochs: 1
  eval_every: 25
  log_every: 1
optim:
  lr: 3.0e-3
  warmup_steps: 10
  weight_decay: 0.01
scaling:
  num_workers: 2
checkpoint:
  every_steps: 25
  keep_last: 2
storage:
  path: {out}/runs
run:
  name: {name}
  max_failures: 2
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "demo")
    p.add_argument("--rows", type=int, default=4000)
    args = p.parse_args(argv)
    out = args.out.resolve()
    assets = out / "assets"
    if not (assets / "model" / "config.json").exists():
        print("building the tiny Llama, its tokenizer and the sample data …", flush=True)
        tiny.build_all(assets, rows=args.rows)
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    job = out / f"{name}.yaml"
    job.write_text(JOB.format(assets=assets, out=out, name=name))
    cfg = load_config(job)
    run_all(cfg, strict=True)

    print("starting a local Ray cluster on 127.0.0.1 …", flush=True)
    cluster = LocalCluster(
        num_cpus=max(2, os.cpu_count() or 2), head_labels={"large_cpu_mem": "true"}
    )
    cluster.start()
    try:
        print(f"Ray dashboard and Jobs API: {cluster.dashboard_url}", flush=True)
        client, job_id = submit.submit(cfg, cluster.dashboard_url, token=cluster.token)
        print(f"submitted job {job_id}", flush=True)
        status, summary = follow.follow(client, job_id, progress=sys.stderr.isatty())
    finally:
        print("stopping the local Ray cluster …", flush=True)
        cluster.stop()
    if status != "SUCCEEDED":
        print(f"demo job {job_id} {status}", file=sys.stderr)
        return 1
    run_dir = out / "runs" / name
    run = report.load_run(str(run_dir))
    png = report.plot(run, out / f"{name}-loss.png", name)
    print("\n=== Raylift demo: done ===")
    for line in report.summary_lines(run):
        print(line)
    print(f"resume checkpoints: {sorted(str(p) for p in run_dir.glob('step_*'))}")
    if summary and summary.get("export"):
        print(
            f"trained model (load with transformers.AutoModelForCausalLM."
            f"from_pretrained): {summary['export']}/model"
        )
    print(f"loss curve: {png}")
    problems = broken_promises(run_dir, run, summary, png)
    for problem in problems:
        print(f"demo: {problem}", file=sys.stderr)
    return 1 if problems else 0


def broken_promises(
    run_dir: Path, run: dict[str, Any], summary: dict[str, Any] | None, png: Path
) -> list[str]:
    """What the demo promises a new user, checked on what it left behind (CI runs `make
    demo` after `make test` and fails on a non-zero exit): every step once, a loss that
    fell, the newest checkpoints only, an export that plain transformers loads, a plot."""
    problems = []
    steps = [r["step"] for r in run["steps"]]
    if not steps or steps != list(range(1, steps[-1] + 1)):
        problems.append(f"steps are not 1..N once each: {steps[:5]}…{steps[-5:]}")
        return problems
    if run["restarts"]:
        problems.append(f"{run['restarts']} restarts in a run nothing interrupted")
    first, last = run["steps"][0]["loss"], run["steps"][-1]["loss"]
    if not last < first - 1.0:
        problems.append(f"the loss did not fall by 1.0: {first:.3f} → {last:.3f}")
    ckpts = sorted(p.name for p in run_dir.glob("step_*"))
    final = f"step_{steps[-1]:08d}"
    if not ckpts or ckpts[-1] != final or len(ckpts) > 2:  # keep_last: 2
        problems.append(f"checkpoints {ckpts}: want the newest two, ending at {final}")
    elif not (run_dir / final / "trainer_state.json").is_file():
        problems.append(f"{run_dir / final} has no trainer_state.json")
    model = run_dir / "export" / final / "model"
    if not summary or Path(str(summary.get("export"))) != model.parent:
        problems.append(f"the job's summary does not name the export {model.parent}")
    else:
        try:
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(model)
        except Exception as exc:  # any failure to load is the broken promise
            problems.append(f"the export {model} does not load with transformers: {exc}")
    if not png.is_file() or png.read_bytes()[:4] != b"\x89PNG":
        problems.append(f"no PNG loss curve at {png}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
