"""The rooms of DESIGN.md, kept by tests rather than by review.

- What a laptop runs before submitting (config, preflight, the planner, tools/plan/ and
  tools/submit.py's validate-and-plan) works with torch, Ray, numpy and pyarrow absent.
- trainer imports neither tools nor infra; infra imports neither trainer nor tools; trainer's
  packages, and the modules inside the planner, the model and the strategies, import only
  from the layers below their own (the import-linter contracts in pyproject.toml). Import
  circles and the layers page are tests/unit/test_import_graph.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.jobs import llama7b_job

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "numpy", "pyarrow")

# A meta-path finder in front of every other one: any import of a heavy package (or one of its
# submodules) fails the way it would on a laptop without it. An optional import that catches
# ImportError still works, as it should.
BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {HEAVY!r}:
                raise ImportError(f"{{name}} is not installed on this laptop")
            return None

    sys.meta_path.insert(0, Absent())
    """
)


def test_laptop_path_runs_without_torch_ray_numpy_or_pyarrow(tmp_path: Path) -> None:
    job = llama7b_job(tmp_path)  # the planner tests' Llama-2-7B job
    code = BLOCKER + textwrap.dedent(
        f"""
        import importlib, json, sys
        for name in ("trainer.config", "trainer.preflight", "trainer.planner.plan",
                     "trainer.planner.report", "trainer.strategies.deepspeed.config",
                     "tools.plan", "tools.submit", "tools.cli", "tools.jobcli.submit"):
            importlib.import_module(name)

        from tools import plan as plan_cli
        from trainer.config import load_config
        from trainer.preflight import run_all

        notes = run_all(load_config({str(job)!r})).notes
        rc = plan_cli.main([{str(job)!r}, "--instance", "g5.xlarge", "--json"])
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {HEAVY!r})
        print(json.dumps({{"rc": rc, "loaded": loaded, "notes": notes}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    *plan_lines, last = proc.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["loaded"] == []
    # Preflight ran to its end: the storage probe (pyarrow) is left to the cluster, saying so.
    assert any("checked on the cluster" in n for n in result["notes"]), result["notes"]
    # A 7B model in full bf16 training does not fit one A10G: the planner ran to its verdict.
    assert result["rc"] == 2
    plan = json.loads("\n".join(plan_lines))
    assert plan["params"] == 6_738_415_616


def test_rooms_import_contracts_are_kept() -> None:
    """In a process of its own: import-linter configures logging with
    disable_existing_loggers, which silenced loggers other tests in this process use."""
    code = (
        "from importlinter.cli import lint_imports; "
        f"raise SystemExit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, "
        "no_cache=True, no_logo=True))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    # trainer-alone, infra-alone, laptop-light, no-circles, the layers of trainer's packages,
    # and those of the planner, the model, the strategies and DeepSpeed's package (each drawn
    # in docs/architecture.md).
    assert "Contracts: 9 kept, 0 broken." in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0
