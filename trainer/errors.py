"""User-facing errors.

A `UserError` is something the person running the job can fix (a config field, a data
line, a missing file). The CLI prints it as one line and exits 2; everything else is a
bug and keeps its traceback.
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
