"""The job the autoscaling test submits: a Ray Train worker group of GPU-shaped workers, rank 0
placed as trainer.runtime.launch places it, on a cluster that starts at zero.

    python -m tests.support.autoscaling_job GCS_ADDRESS AUTOSCALER_YAML WORKERS SECONDS OUT.json

Each worker reports where it ran (its node's instance id and pool) and keeps busy for SECONDS
(longer than the idle timeout, so an autoscaler that ended busy nodes would be caught).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def train_func(config: dict) -> None:
    import os

    import ray.train
    import torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    end = time.monotonic() + config["seconds"]
    total = torch.zeros(1)
    while True:  # the workload: all-reduces until rank 0's clock says the job is done
        go = torch.tensor([1.0 if time.monotonic() < end else 0.0])
        dist.broadcast(go, src=0)
        if go.item() == 0:
            break
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
    row = {
        "rank": ctx.get_world_rank(),
        "instance": os.environ.get("RAY_CLOUD_INSTANCE_ID", ""),
        "pool": os.environ.get("RAY_NODE_TYPE_NAME", ""),
        "all_reduces": float(total.item()),
    }
    # One machine: the workers' rows land beside the driver's file.
    with open(f"{config['out']}.rank{row['rank']}", "w") as f:
        json.dump(row, f)


def main() -> None:
    address, autoscaler_yaml, workers, seconds, out = sys.argv[1:6]
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trainer.autoscaling.placement import launchable_labels, rank0_selector

    ray.init(address=address, logging_level="WARNING")
    live = [n.get("Labels") or {} for n in ray.nodes() if n.get("Alive")]
    selector = rank0_selector(
        {"large_cpu_mem": "true"}, int(workers), live, launchable_labels(autoscaler_yaml)
    )
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"seconds": float(seconds), "out": out},
        scaling_config=ScalingConfig(
            num_workers=int(workers),
            use_gpu=False,
            resources_per_worker={"CPU": 1, "gpu_slot": 1},
            label_selector=selector,
        ),
        run_config=RunConfig(name="autoscaling", storage_path=out + ".ray"),
        torch_config=TorchConfig(backend="gloo"),
    )
    started = time.time()
    trainer.fit()
    rows = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(int(workers))]
    with open(out, "w") as f:
        json.dump({"selector": selector, "workers": rows, "fit_s": time.time() - started}, f)


if __name__ == "__main__":
    main()
