"""User-facing errors.

A `UserError` is something the person running the job can fix (a config field, a data
line, a missing file). The CLI prints it as one line and exits 2; everything else is a
bug and keeps its traceback.

A `NotRetried` error is one a restart cannot fix (the same weights fail the same check):
Ray Train would charge it to run.max_failures and retry the attempt from the last
checkpoint, training again only to fail again. The controller's `StopOnUserError`
callback (trainer.resilience.callbacks) ends the run on it instead.
"""


class UserError(Exception):
    """A problem in the user's input: printed as one line, no traceback."""


class ConfigError(UserError):
    """The job config is invalid. The message names the field (and file:line when known)."""


class DataError(UserError):
    """A data file is malformed. The message names file:line."""


class CheckpointError(UserError):
    """A checkpoint exists but cannot be used. Never answered by training from scratch."""


class DeviceError(UserError):
    """The job asks for hardware this node does not have (a GPU path on a CPU node)."""


class NotRetried(UserError):
    """A worker's user error that a restart would only repeat: the run ends on it."""


def not_retried(exc: BaseException) -> NotRetried | None:
    """`exc` itself, or the worker exception Ray Train wraps it in (its `_base_exc`), when
    it is a `NotRetried` error; None otherwise."""
    inner = getattr(exc, "_base_exc", exc)
    return inner if isinstance(inner, NotRetried) else None
