"""The image tool's errors: what the user can fix (one line, exit 2), and what is worth a retry."""

from __future__ import annotations

from collections.abc import Sequence


class UserError(Exception):
    """A problem the user can fix; shown as one line (no traceback unless --debug)."""


class EngineUnavailable(UserError):
    """No Docker engine answers; building or pushing cannot start."""


class BuildFailed(UserError):
    """`docker build` exited non-zero; carries the failing step and the log tail."""

    def __init__(self, message: str, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tail = list(tail)


class PushFailed(UserError):
    """A push failed for good (permanent error, or transient errors past the retry budget)."""


class TransientError(Exception):
    """A failure worth retrying: the registry or the network hiccupped, not the request."""
