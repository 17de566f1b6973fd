"""A failed export check ends the run with one line instead of being retried: the error is
a `NotRetried` user error, the controller's StopOnUserError callback raises it out of the
worker group's failure hook, and Ray Train's own failure policy (the installed one, no
cluster) then decides RAISE where a worker's ordinary error is a RETRY. The CLI prints the
check's line: the export, the max difference and the tolerance."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray.train import FailureConfig
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from trainer.__main__ import _root_cause
from trainer.checkpoint.export_check import ExportCheckError, compare, require
from trainer.errors import NotRetried, not_retried
from trainer.resilience.callbacks import StopOnUserError


def _failed_check() -> ExportCheckError:
    want = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    got = want.clone()
    got[1, 0] += 0.2
    with pytest.raises(ExportCheckError) as err:
        require(compare("model_merged", "base + adapter", got, want, 1e-5))
    return err.value


def _decide(worker_exceptions: dict[int, Exception]) -> tuple[FailureDecision, Exception]:
    """What the controller does with a failed worker group: the user callbacks' hook
    first (an error out of it becomes a ControllerError), then the failure policy."""
    policy = DefaultFailurePolicy(FailureConfig(max_failures=3))
    try:
        StopOnUserError().after_exception(None, worker_exceptions)
    except Exception as exc:
        error: Exception = ControllerError(exc)
    else:
        error = WorkerGroupError("a worker failed", worker_exceptions)
    return policy.make_decision(error), error


def test_a_failed_export_check_is_raised_not_retried() -> None:
    check_error = _failed_check()
    assert isinstance(check_error, NotRetried)
    wrapped = UserExceptionWithTraceback(check_error, "Traceback ...\nExportCheckError: ...")
    decision, error = _decide({1: RuntimeError("peer closed"), 0: wrapped})
    assert decision is FailureDecision.RAISE
    # What fit() raises on the driver (pickled across) leads the CLI to the check's line.
    cause = _root_cause(pickle.loads(pickle.dumps(error)))
    line = str(cause)
    assert isinstance(cause, ExportCheckError) and "\n" not in line
    assert line.startswith("export check failed: model_merged: logits DO NOT match")
    assert "max difference 0.2," in line and "tolerance 1e-05" in line


def test_an_ordinary_worker_error_is_still_retried() -> None:
    wrapped = UserExceptionWithTraceback(RuntimeError("CUDA error"), "Traceback ...")
    decision, _ = _decide({0: wrapped})
    assert decision is FailureDecision.RETRY
    assert not_retried(wrapped) is None and not_retried(RuntimeError()) is None
