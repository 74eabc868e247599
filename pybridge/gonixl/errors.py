"""Exceptions raised for gonixl status codes.

One function, :func:`check`, turns a status code and the per-call error
struct into the matching exception. The codes mirror ``include/gonixl.h``.
"""

from __future__ import annotations

OK = 0
IN_PROGRESS = 1
ERR_INTERNAL = -1
ERR_INVALID_ARGUMENT = -2
ERR_NULL_POINTER = -3
ERR_INVALID_HANDLE = -4
ERR_WRONG_HANDLE = -5
ERR_BUFFER_TOO_SMALL = -6
ERR_POISONED = -7
ERR_UNAVAILABLE = -8
ERR_NOT_SUPPORTED = -9
ERR_TRANSFER = -10
ERR_TIMEOUT = -11
ERR_STATE = -12

STATUS_NAMES = {
    OK: "GONIXL_OK",
    IN_PROGRESS: "GONIXL_IN_PROGRESS",
    ERR_INTERNAL: "GONIXL_ERR_INTERNAL",
    ERR_INVALID_ARGUMENT: "GONIXL_ERR_INVALID_ARGUMENT",
    ERR_NULL_POINTER: "GONIXL_ERR_NULL_POINTER",
    ERR_INVALID_HANDLE: "GONIXL_ERR_INVALID_HANDLE",
    ERR_WRONG_HANDLE: "GONIXL_ERR_WRONG_HANDLE",
    ERR_BUFFER_TOO_SMALL: "GONIXL_ERR_BUFFER_TOO_SMALL",
    ERR_POISONED: "GONIXL_ERR_POISONED",
    ERR_UNAVAILABLE: "GONIXL_ERR_UNAVAILABLE",
    ERR_NOT_SUPPORTED: "GONIXL_ERR_NOT_SUPPORTED",
    ERR_TRANSFER: "GONIXL_ERR_TRANSFER",
    ERR_TIMEOUT: "GONIXL_ERR_TIMEOUT",
    ERR_STATE: "GONIXL_ERR_STATE",
}


class GoNixlError(Exception):
    """Base class: a call into libgonixl.so failed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")


class LibraryLoadError(GoNixlError):
    """libgonixl.so could not be found or loaded, or its ABI differs."""

    def __init__(self, message: str):
        super().__init__(ERR_UNAVAILABLE, message)


class InvalidArgumentError(GoNixlError, ValueError):
    """Bad input: invalid JSON, value, length or NULL pointer."""


class InvalidHandleError(GoNixlError):
    """A handle that is 0, unknown, closed, or of another kind."""


class BufferTooSmallError(GoNixlError):
    """Size negotiation failed (the bridge retries; seen only on bugs)."""


class PoisonedError(GoNixlError):
    """The library panicked earlier and refuses further calls."""


class InternalError(GoNixlError):
    """A bug inside the library (a recovered Go panic)."""


class UnavailableError(GoNixlError):
    """A native dependency (NIXL, UCX) cannot be used on this host."""


class NotSupportedError(GoNixlError):
    """A valid request the library does not implement."""


class TransferError(GoNixlError):
    """A transfer or handshake failed."""


class TimeoutError(GoNixlError):  # noqa: A001 - deliberately shadows in this module
    """A deadline passed."""


class StateError(GoNixlError):
    """The call is not valid in the object's current state."""


_BY_STATUS = {
    ERR_INTERNAL: InternalError,
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_NULL_POINTER: InvalidArgumentError,
    ERR_INVALID_HANDLE: InvalidHandleError,
    ERR_WRONG_HANDLE: InvalidHandleError,
    ERR_BUFFER_TOO_SMALL: BufferTooSmallError,
    ERR_POISONED: PoisonedError,
    ERR_UNAVAILABLE: UnavailableError,
    ERR_NOT_SUPPORTED: NotSupportedError,
    ERR_TRANSFER: TransferError,
    ERR_TIMEOUT: TimeoutError,
    ERR_STATE: StateError,
}


def error_for(status: int, message: str) -> GoNixlError:
    """The exception for a negative status."""
    cls = _BY_STATUS.get(status, GoNixlError)
    return cls(status, message or STATUS_NAMES.get(status, f"status {status}"))
