"""What `make demo` promises a new user, checked on what the run left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def broken_promises(
    run_dir: Path, run: dict[str, Any], summary: dict[str, Any] | None, png: Path
) -> list[str]:
    """What the demo promises a new user, checked on what it left behind (CI runs `make
    demo` after `make test` and fails on a non-zero exit): every step once, a loss that
    fell, the newest checkpoints only, an export that plain transformers loads, the benchmark
    scored before and after training, a plot."""
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
    scored = [r["step"] for r in run.get("benchmarks") or []]
    if scored[:1] != [0] or scored[-1:] != steps[-1:]:
        problems.append(f"the benchmark was not scored before step 1 and at the last: {scored}")
    if not png.is_file() or png.read_bytes()[:4] != b"\x89PNG":
        problems.append(f"no PNG loss curve at {png}")
    return problems
