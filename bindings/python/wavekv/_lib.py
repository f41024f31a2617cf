"""Finding and loading libwavekv, and the ctypes declarations of wavekv.h.

Only the functions and structs of the public header are declared here; the
binding calls nothing else. The structs mirror the header field by field (a
test compiles a C program that prints their sizes and offsets and compares).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from pathlib import Path
from typing import Any, List, Optional, Tuple, Type, TypeVar

from .errors import LibraryNotFoundError, error_for_status

__all__ = ["lib", "library_path", "check", "WkvConfig", "WkvStats", "WkvSeqInfo", "WkvXbufView"]

# The library major version this binding speaks (WKV_VERSION_MAJOR).
ABI_MAJOR = 0
# The minor version of the header the declarations below mirror (wkv_stats
# as of 0.8, wkv_seq_info as of 0.6; wkv_append_batch: 0.5; wkv_plan_bind,
# _prepare and _unbind: 0.9; wkv_config.page_format: 0.10; its value
# int8-centered: 0.11). An older library
# from 0.5 on has every function of _SIGNATURES and leaves the fields it
# lacks 0 (its wkv_stats_init and wkv_seq_info_init set its own sizes); the
# functions of _SINCE it may lack are refused when called (UnsupportedError),
# and so is a page_format other than storage (before 0.10 the field was
# reserved0, which had to be 0), or int8-centered before 0.11.
ABI_MINOR = 11
# The minor version that gave wkv_config its page_format, and the one that
# gave each page format (by its C value).
PAGE_FORMAT_SINCE = 10
PAGE_FORMAT_VALUE_SINCE = {1: 10, 2: 11}
# The oldest minor version that loads (wkv_append_batch).
ABI_MIN_MINOR = 5
WKV_SAVE_NO_FSYNC = 1

c_void_p = ctypes.c_void_p
c_uint32 = ctypes.c_uint32
c_int32 = ctypes.c_int32
c_int64 = ctypes.c_int64
c_uint64 = ctypes.c_uint64
c_float = ctypes.c_float


class WkvConfig(ctypes.Structure):
    """struct wkv_config"""

    _fields_ = [
        ("size", c_uint32),
        ("device", c_uint32),
        ("device_id", c_int32),
        ("n_layers", c_uint32),
        ("n_q_heads", c_uint32),
        ("n_kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_uint32),
        ("segment_tokens", c_uint32),
        ("update_segment_tokens", c_uint32),
        ("cluster_tokens", c_uint32),
        ("kmeans_iters", c_uint32),
        ("sink_tokens", c_uint32),
        ("window_tokens", c_uint32),
        ("retrieval_frac", c_float),
        ("estimation_frac", c_float),
        ("page_bytes", c_uint32),
        ("threads", c_uint32),
        ("flags", c_uint32),
        ("page_format", c_uint32),
        ("host_budget_bytes", c_uint64),
        ("host_chunk_bytes", c_uint64),
        ("device_cache_bytes", c_uint64),
        ("seed", c_uint64),
        ("stats_path", ctypes.c_char_p),
        ("stats_interval_ms", c_uint32),
        ("method", c_uint32),
        ("reserved1", c_uint32),
        ("spill_dir", ctypes.c_char_p),
        ("spill_budget_bytes", c_uint64),
    ]


class WkvStats(ctypes.Structure):
    """struct wkv_stats"""

    _fields_ = [
        ("size", c_uint32),
        ("device", c_uint32),
        ("sequences", c_uint64),
        ("tokens", c_uint64),
        ("segments", c_uint64),
        ("clusters", c_uint64),
        ("host_bytes_reserved", c_uint64),
        ("host_bytes_used", c_uint64),
        ("host_budget_bytes", c_uint64),
        ("page_bytes", c_uint64),
        ("pages_used", c_uint64),
        ("pages_free", c_uint64),
        ("steady_bytes", c_uint64),
        ("meta_bytes", c_uint64),
        ("lookups", c_uint64),
        ("retrieved_clusters", c_uint64),
        ("estimated_clusters", c_uint64),
        ("attended_tokens", c_uint64),
        ("cache_hits", c_uint64),
        ("cache_misses", c_uint64),
        ("device_cache_bytes", c_uint64),
        ("kmeans_ns", c_uint64),
        ("cache_admissions", c_uint64),
        ("cache_evictions", c_uint64),
        ("manager_backlog", c_uint64),
        ("pin_fallbacks", c_uint64),
        ("spill_io", c_uint64),
        ("spill_bytes_used", c_uint64),
        ("spill_file_bytes", c_uint64),
        ("spill_budget_bytes", c_uint64),
        ("spill_bytes_written", c_uint64),
        ("spill_bytes_read", c_uint64),
        ("evicted_sequences", c_uint64),
        ("spill_cold_pages", c_uint64),
        ("spill_pages_written", c_uint64),
        ("spill_pages_read", c_uint64),
        ("spill_estimated", c_uint64),
        ("spill_read_errors", c_uint64),
        ("spill_write_errors", c_uint64),
        ("cache_frames_given", c_uint64),
        ("cache_records_dropped", c_uint64),
        ("growths_deferred", c_uint64),
        ("growth_waits", c_uint64),
        ("decode_graphs", c_uint64),
        ("device_bytes_reserved", c_uint64),
        ("device_bytes_used", c_uint64),
        ("meta_device_bytes", c_uint64),
        ("meta_host_rows_reserved", c_uint64),
    ]


class WkvSeqInfo(ctypes.Structure):
    """struct wkv_seq_info"""

    _fields_ = [
        ("size", c_uint32),
        ("generating", c_uint32),
        ("tokens", c_uint64),
        ("clustered", c_uint64),
        ("sink", c_uint64),
        ("tail", c_uint64),
        ("segments", c_uint64),
        ("clusters", c_uint64),
        ("pages", c_uint64),
        ("evicted", c_uint32),
        ("reserved", c_uint32),
        ("spilled_pages", c_uint64),
    ]


class WkvXbufView(ctypes.Structure):
    """struct wkv_xbuf_view"""

    _fields_ = [
        ("size", c_uint32),
        ("n_runs", c_uint32),
        ("n_tokens", c_uint64),
        ("head_dim", c_uint32),
        ("dtype", c_uint32),
        ("k", c_void_p),
        ("v", c_void_p),
        ("offsets", c_void_p),
    ]


# name: (restype, argtypes). Pointers to handles and tensors are c_void_p.
_P = c_void_p
_PP = ctypes.POINTER(c_void_p)
_SIGNATURES = {
    "wkv_version": (ctypes.c_int, []),
    "wkv_version_string": (ctypes.c_char_p, []),
    "wkv_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "wkv_last_error": (ctypes.c_char_p, []),
    "wkv_free": (None, [_P]),
    "wkv_config_init": (None, [_P]),
    "wkv_engine_open": (ctypes.c_int, [ctypes.POINTER(WkvConfig), _PP]),
    "wkv_engine_close": (None, [_P]),
    "wkv_engine_config": (ctypes.c_int, [_P, ctypes.POINTER(WkvConfig)]),
    "wkv_engine_device": (ctypes.c_int, [_P, ctypes.POINTER(c_uint32)]),
    "wkv_stats_init": (None, [_P]),
    "wkv_engine_stats": (ctypes.c_int, [_P, ctypes.POINTER(WkvStats)]),
    "wkv_engine_stats_json": (ctypes.c_int, [_P, _PP]),
    "wkv_seq_create": (ctypes.c_int, [_P, _PP]),
    "wkv_seq_destroy": (None, [_P]),
    "wkv_seq_append": (ctypes.c_int, [_P, c_uint32, _P, _P, c_uint32, c_int64, c_int64, _P]),
    "wkv_append_batch": (
        ctypes.c_int,
        [_PP, c_uint32, c_uint32, _P, _P, c_uint32, c_int64, c_int64, c_int64, _P],
    ),
    "wkv_seq_end_prompt": (ctypes.c_int, [_P, c_uint32, _P]),
    "wkv_seq_info_init": (None, [_P]),
    "wkv_seq_info_get": (ctypes.c_int, [_P, c_uint32, ctypes.POINTER(WkvSeqInfo)]),
    "wkv_seq_save": (ctypes.c_int, [_P, ctypes.c_char_p, c_uint32]),
    "wkv_seq_evict": (ctypes.c_int, [_P]),
    "wkv_seq_restore": (ctypes.c_int, [_P]),
    "wkv_seq_load": (ctypes.c_int, [_P, ctypes.c_char_p, _PP]),
    "wkv_plan_create": (ctypes.c_int, [_P, _PP]),
    "wkv_plan_destroy": (None, [_P]),
    "wkv_lookup": (ctypes.c_int, [_P, _PP, c_uint32, c_uint32, _P, c_int64, c_int64, _P]),
    "wkv_assemble": (ctypes.c_int, [_P, _P]),
    "wkv_xbuf_view_init": (None, [_P]),
    "wkv_plan_xbuf": (ctypes.c_int, [_P, ctypes.POINTER(WkvXbufView)]),
    "wkv_attend": (ctypes.c_int, [_P, _P, c_int64, c_int64, _P, _P]),
    "wkv_merge": (ctypes.c_int, [_P, _P, c_int64, c_int64, _P, c_int64, _P]),
    "wkv_update": (ctypes.c_int, [_P, _P]),
    "wkv_decode": (
        ctypes.c_int,
        [_P, _PP, c_uint32, c_uint32, _P, c_int64, c_int64, _P, c_int64, c_int64, _P],
    ),
    # 0.9 (optional: see _SINCE)
    "wkv_plan_bind": (ctypes.c_int, [_P, _PP, c_uint32, c_uint32, _P]),
    "wkv_plan_prepare": (ctypes.c_int, [_P, _P]),
    "wkv_plan_unbind": (ctypes.c_int, [_P, _P]),
}

# Functions newer than ABI_MIN_MINOR: a library without them still loads,
# and calling them raises UnsupportedError (see function()).
_SINCE = {
    "wkv_plan_bind": 9,
    "wkv_plan_prepare": 9,
    "wkv_plan_unbind": 9,
}

_LIB_NAMES = ("libwavekv.so.%d" % ABI_MAJOR, "libwavekv.so")


def _checkout_root() -> Optional[Path]:
    """The source tree this package sits in (bindings/python/wavekv), if any."""
    root = Path(__file__).resolve().parents[3]
    if (root / "include" / "wavekv" / "wavekv.h").is_file():
        return root
    return None


def _is_sanitizer_build(build_dir: Path) -> bool:
    # A sanitizer runtime must be the first library of a process: python
    # would abort when loading such a libwavekv.
    try:
        for line in (build_dir / "CMakeCache.txt").read_text(errors="replace").splitlines():
            if line.startswith("WKV_SANITIZE:"):
                return line.split("=", 1)[1].strip() != ""
    except OSError:
        pass
    return False


def _tree_candidates(root: Path) -> List[str]:
    """libwavekv in the tree's build directories: build/ first, then build-*/
    newest first, leaving out sanitizer builds."""

    def library_in(build_dir: Path) -> Optional[str]:
        if _is_sanitizer_build(build_dir):
            return None
        for name in _LIB_NAMES:
            path = build_dir / "lib" / name
            if path.exists():
                return str(path)
        return None

    main = library_in(root / "build")
    others = [p for p in (library_in(Path(d)) for d in glob.glob(str(root / "build-*"))) if p]
    others.sort(key=os.path.getmtime, reverse=True)
    return ([main] if main else []) + others


def _candidates() -> Tuple[List[str], List[str]]:
    """(paths or names to try in order, descriptions of where it looked)."""
    tried: List[str] = []
    where: List[str] = []
    env = os.environ.get("WAVEKV_LIBRARY")
    if env:
        path = Path(env)
        if path.is_dir():
            for name in _LIB_NAMES:
                if (path / name).exists():
                    path = path / name
                    break
        # An explicit path is the only candidate: a wrong one must not fall
        # back silently to another library.
        return [str(path)], ["WAVEKV_LIBRARY=%s" % env]
    root = _checkout_root()
    if root is not None:
        where.append("%s/build/lib and %s/build-*/lib (this checkout)" % (root, root))
        tried += _tree_candidates(root)
    found = ctypes.util.find_library("wavekv")
    where.append("ctypes.util.find_library('wavekv')" + (" -> %s" % found if found else " (nothing)"))
    if found:
        tried.append(found)
    where.append("the dynamic loader's search path (LD_LIBRARY_PATH, ld.so.cache, /usr/lib)")
    tried += list(_LIB_NAMES)
    for prefix in ("/usr/local/lib", "/usr/local/lib64"):
        where.append(prefix)
        tried += [os.path.join(prefix, name) for name in _LIB_NAMES]
    return tried, where


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


def _load() -> ctypes.CDLL:
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        tried, where = _candidates()
        errors: List[str] = []
        for cand in tried:
            try:
                lib = ctypes.CDLL(cand)
            except OSError as exc:
                if os.path.sep in cand and os.path.exists(cand):
                    errors.append("%s: %s" % (cand, exc))
                elif os.environ.get("WAVEKV_LIBRARY"):
                    errors.append("%s: %s" % (cand, exc))
                continue
            for name, (restype, argtypes) in _SIGNATURES.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError:
                    if name in _SINCE:
                        continue
                    raise LibraryNotFoundError(
                        "%s lacks %s: not a libwavekv of ABI %d.%d or later (an older or foreign library)"
                        % (cand, name, ABI_MAJOR, ABI_MIN_MINOR)
                    ) from None
                fn.restype = restype
                fn.argtypes = argtypes
            major = lib.wkv_version() // 10000
            if major != ABI_MAJOR:
                raise LibraryNotFoundError(
                    "%s is libwavekv %s; this binding needs major version %d"
                    % (cand, lib.wkv_version_string().decode(), ABI_MAJOR)
                )
            _lib, _path = lib, _resolved_path(lib, cand)
            return lib
        msg = "libwavekv not found. Looked in: " + "; ".join(where) + "."
        if errors:
            msg += " Failed to load: " + "; ".join(errors) + "."
        msg += " Set WAVEKV_LIBRARY to the path of libwavekv.so, or build the tree (make)."
        raise LibraryNotFoundError(msg)


def _resolved_path(lib: ctypes.CDLL, name: str) -> str:
    """The file the loader chose for `name` (from /proc/self/maps on Linux)."""
    if os.path.sep in name:
        return os.path.realpath(name)
    try:
        addr = ctypes.cast(lib.wkv_version, c_void_p).value or 0
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi and len(parts) >= 6:
                    return parts[5]
    except (OSError, ValueError):
        pass
    return name


def lib() -> ctypes.CDLL:
    """The loaded libwavekv (loaded on first use)."""
    return _lib if _lib is not None else _load()


def function(name: str, caller: str) -> Any:
    """The library's function `name`, or UnsupportedError when the library
    loaded is older than the version that added it (_SINCE)."""
    try:
        return getattr(lib(), name)
    except AttributeError:
        raise error_for_status(4, "%s: the libwavekv loaded (%s) lacks %s, new in %d.%d"
                               % (caller, lib().wkv_version_string().decode(), name,
                                  ABI_MAJOR, _SINCE.get(name, ABI_MINOR))) from None


def library_minor() -> int:
    """The loaded library's minor version (wkv_version)."""
    return int(lib().wkv_version()) // 100 % 100


def library_path() -> str:
    """The path of the libwavekv this process loaded (loading it if needed)."""
    lib()
    assert _path is not None
    return _path


# Room past a struct for what a newer library's struct may add.
_STRUCT_SLACK = 4096

_S = TypeVar("_S", bound=ctypes.Structure)


def init_struct(cls: Type[_S], init: str) -> _S:
    """A struct filled by its *_init function, safe against a library whose
    struct is larger than this binding's: the function writes into a buffer
    with room to spare, this binding keeps the prefix it knows and sets
    `size` to it, and the library then reads and writes only that prefix
    (wavekv.h: structs that may grow)."""
    n = ctypes.sizeof(cls)
    buf = ctypes.create_string_buffer(n + _STRUCT_SLACK)
    getattr(lib(), init)(ctypes.cast(buf, c_void_p))
    out = cls.from_buffer_copy(buf.raw[:n])
    out.size = min(out.size, n)
    return out


def last_error() -> str:
    """The calling thread's last library message."""
    msg = lib().wkv_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status: int) -> None:
    """Raises the exception of a non-zero status with the library's message."""
    if status != 0:
        raise error_for_status(status, last_error())
