"""`make demo`: the production path, end to end, on this machine.

Builds a tiny Llama and a tokenizer trained here, generates a GSM8K-shaped dataset in the
Ray Llama template's format, starts a local Ray cluster on 127.0.0.1, submits the job
through the Jobs API exactly as `raylift run` (tools/jobcli) does against a real cluster,
follows it, plots the loss (and the benchmark's score before and after training), and
stops the cluster it started.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tools import report, tiny
from tools.demo.bench import write_task
from tools.demo.job import JOB, with_benchmark
from tools.demo.promises import broken_promises
from tools.jobcli import follow, submit
from tools.localcluster import LocalCluster
from trainer.config import load_config
from trainer.preflight import run_all

ROOT = Path(__file__).resolve().parents[2]


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
    task = write_task(assets / "bench")
    job.write_text(with_benchmark(JOB.format(assets=assets, out=out, name=name), str(task)))
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
