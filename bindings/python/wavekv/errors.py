"""Exceptions: one class per wavekv status code.

Every failure that libwavekv reports, and every argument the binding refuses
before calling in, is raised as a subclass of :class:`WavekvError` carrying the
status code (``WKV_ERR_*``) and a message in words. Failures the library
reports carry the library's own message (``wkv_last_error``); failures the
binding detects first carry the binding's.
"""

from __future__ import annotations

from typing import Dict, Type

__all__ = [
    "WavekvError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "OutOfRangeError",
    "UnsupportedError",
    "BudgetError",
    "OutOfMemoryError",
    "DeviceError",
    "FileIOError",
    "CorruptError",
    "StateError",
    "InternalError",
    "NoDeviceError",
    "LibraryNotFoundError",
    "error_for_status",
]

# The status codes of wavekv.h; values are never renumbered or reused.
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_HANDLE = 2
ERR_OUT_OF_RANGE = 3
ERR_UNSUPPORTED = 4
ERR_BUDGET = 5
ERR_OUT_OF_MEMORY = 6
ERR_DEVICE = 7
ERR_IO = 8
ERR_CORRUPT = 9
ERR_STATE = 10
ERR_INTERNAL = 11
ERR_NO_DEVICE = 12

_STATUS_NAMES = {
    OK: "WKV_OK",
    ERR_INVALID_ARGUMENT: "WKV_ERR_INVALID_ARGUMENT",
    ERR_INVALID_HANDLE: "WKV_ERR_INVALID_HANDLE",
    ERR_OUT_OF_RANGE: "WKV_ERR_OUT_OF_RANGE",
    ERR_UNSUPPORTED: "WKV_ERR_UNSUPPORTED",
    ERR_BUDGET: "WKV_ERR_BUDGET",
    ERR_OUT_OF_MEMORY: "WKV_ERR_OUT_OF_MEMORY",
    ERR_DEVICE: "WKV_ERR_DEVICE",
    ERR_IO: "WKV_ERR_IO",
    ERR_CORRUPT: "WKV_ERR_CORRUPT",
    ERR_STATE: "WKV_ERR_STATE",
    ERR_INTERNAL: "WKV_ERR_INTERNAL",
    ERR_NO_DEVICE: "WKV_ERR_NO_DEVICE",
}


def status_name(status: int) -> str:
    """The ``WKV_*`` name of a status code, or ``"WKV_ERR_<n>"`` if unknown."""
    return _STATUS_NAMES.get(status, "WKV_ERR_%d" % status)


class WavekvError(Exception):
    """A failure reported by libwavekv or refused by the binding.

    Attributes:
        status: the ``WKV_ERR_*`` code (an int).
        status_name: its name, such as ``"WKV_ERR_BUDGET"``.
        message: the message in words (the library's, where it reported it).
    """

    #: the status code of the class; the base class serves unknown codes
    code: int = -1

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.status_name = status_name(status)
        self.message = message

    def __str__(self) -> str:
        return "%s: %s" % (self.status_name, self.message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Subclasses take (status, message) too, so that pickling round-trips.
        return (type(self), (self.status, self.message))


class InvalidArgumentError(WavekvError, ValueError):
    """A null pointer, zero size, bad shape, dtype, device, stride or value."""

    code = ERR_INVALID_ARGUMENT


class InvalidHandleError(WavekvError, ValueError):
    """A closed (destroyed) or foreign engine, sequence or plan.

    Every method of a closed object raises it, as a closed file raises
    ValueError.
    """

    code = ERR_INVALID_HANDLE


class OutOfRangeError(WavekvError, IndexError):
    """An index (layer, head, token) past its bound."""

    code = ERR_OUT_OF_RANGE


class UnsupportedError(WavekvError):
    """A head_dim, dtype or device this build cannot serve."""

    code = ERR_UNSUPPORTED


class BudgetError(WavekvError):
    """The configured host byte budget would be exceeded."""

    code = ERR_BUDGET


class OutOfMemoryError(WavekvError):
    """The host or device allocator failed."""

    code = ERR_OUT_OF_MEMORY


class DeviceError(WavekvError):
    """The GPU runtime reported an error."""

    code = ERR_DEVICE


class FileIOError(WavekvError):
    """A file read or write failed (WKV_ERR_IO; named so as not to shadow IOError)."""

    code = ERR_IO


class CorruptError(WavekvError):
    """A file failed its checksum or structure checks."""

    code = ERR_CORRUPT


class StateError(WavekvError):
    """A call out of order (assemble before lookup, ...), or an object used by
    two threads at once."""

    code = ERR_STATE


class InternalError(WavekvError):
    """A bug in wavekv: please report it."""

    code = ERR_INTERNAL


class NoDeviceError(WavekvError):
    """A CUDA engine was asked for and no GPU is usable."""

    code = ERR_NO_DEVICE


_BY_STATUS: Dict[int, Type[WavekvError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        InvalidHandleError,
        OutOfRangeError,
        UnsupportedError,
        BudgetError,
        OutOfMemoryError,
        DeviceError,
        FileIOError,
        CorruptError,
        StateError,
        InternalError,
        NoDeviceError,
    )
}


def error_for_status(status: int, message: str) -> WavekvError:
    """The exception for a status code: its class, or WavekvError if unknown."""
    return _BY_STATUS.get(status, WavekvError)(status, message)


class LibraryNotFoundError(OSError):
    """libwavekv could not be found or loaded; the message lists where the
    binding looked."""
