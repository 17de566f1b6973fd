"""Turning a `train.rl.rewards` entry into the function it names.

A user's reward is imported from its file by path (never through `sys.path`), under a
module name of its own, so two files with the same name cannot shadow each other. The
same loader runs in the training process and in a reward task on another node: each
imports the file where it runs.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.config.rl import RewardSpec
from trainer.rewards.builtin import BUILTINS
from trainer.rewards.checks import RewardError


def load_function(spec: RewardSpec, base: Path) -> Callable[..., Any]:
    """The callable `spec` names: a built-in with its options bound, or `name` from the
    file (relative to `base`), imported under a module name of its own."""
    if spec.location is None:
        fn = BUILTINS[spec.function]
        options = dict(spec.options)
        return lambda prompts, completions, **cols: fn(prompts, completions, **options, **cols)
    file, name = spec.location
    path = (base / file).resolve()
    where = f"train.rl.rewards: {spec.function}"
    if not path.is_file():
        raise RewardError(f"{where}: no file {path}; give the path relative to {base}")
    module_name = f"raylift_reward_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, path)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            raise RewardError(
                f"{where}: importing {path} raised {type(e).__name__}: {e}; fix the file"
            ) from e
        sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{where}: {path} has no function {name!r}; check the name")
    return fn
