"""wavekv: Python bindings of libwavekv, a KV-cache storage engine for
long-context LLM inference.

    import numpy as np, wavekv
    with wavekv.Engine(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, dtype="f32") as eng:
        with eng.sequence() as seq, eng.plan() as plan:
            seq.append(0, k, v)                 # [n_tokens][n_kv_heads][head_dim]
            out = plan.decode([seq], 0, q)      # q: [n_seqs][n_q_heads][head_dim]

The package is pure Python over ctypes; libwavekv is found through
WAVEKV_LIBRARY, the build directories of the source tree the package sits in,
or the system's library path (see library_path()). Tensors (NumPy, PyTorch,
CuPy, JAX, or anything with DLPack or an array interface) are read in place,
never copied. Errors raise subclasses of WavekvError, one per status code.
"""

from __future__ import annotations

from . import errors
from ._lib import library_path
from .engine import (
    PAGE_FORMAT_INT8,
    PAGE_FORMAT_INT8_CENTERED,
    PAGE_FORMAT_STORAGE,
    Config,
    Engine,
    Plan,
    RawArray,
    SeqInfo,
    Sequence,
    Stats,
    XBuf,
)
from .errors import (
    BudgetError,
    CorruptError,
    DeviceError,
    FileIOError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    LibraryNotFoundError,
    NoDeviceError,
    OutOfMemoryError,
    OutOfRangeError,
    StateError,
    UnsupportedError,
    WavekvError,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "Engine",
    "Sequence",
    "Plan",
    "Stats",
    "SeqInfo",
    "XBuf",
    "RawArray",
    "PAGE_FORMAT_STORAGE",
    "PAGE_FORMAT_INT8",
    "PAGE_FORMAT_INT8_CENTERED",
    "library_path",
    "library_version",
    "errors",
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
]


def library_version() -> str:
    """The loaded libwavekv's version, "major.minor.patch" (wkv_version_string)."""
    from ._lib import lib

    return str(lib().wkv_version_string().decode())
