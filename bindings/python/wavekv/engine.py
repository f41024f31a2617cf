"""Engines, sequences and plans: thin owners of the C ABI's handles.

Each object owns one handle, closes it exactly once (``close()``, the end of a
``with`` block, or as a fallback when garbage-collected) and raises
InvalidHandleError from every method after that. Tensors are read in place
(see ``_tensor``) and checked against the engine's shape, dtype and device
before the library is called.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import operator
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, TypeVar, Union

from . import _lib
from . import _tensor as T
from .errors import InvalidArgumentError, InvalidHandleError, OutOfRangeError, StateError, UnsupportedError

__all__ = ["Config", "Engine", "Sequence", "Plan", "Stats", "SeqInfo", "XBuf", "RawArray",
           "PAGE_FORMAT_STORAGE", "PAGE_FORMAT_INT8", "PAGE_FORMAT_INT8_CENTERED"]

_DTYPES = {"f32": 0, "f16": 1, "bf16": 2}
_DTYPE_ALIASES = {
    "f32": "f32", "float32": "f32", "float": "f32",
    "f16": "f16", "float16": "f16", "half": "f16",
    "bf16": "bf16", "bfloat16": "bf16",
}
_TENSOR_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
_DEVICES = {"cpu": 0, "cuda": 1, "auto": 2}
_DEVICE_NAMES = {v: k for k, v in _DEVICES.items()}

# How K and V rows are kept in pages (Config.page_format, WKV_PAGE_FORMAT_*,
# 0.10); named as dtype and device are, the C values accepted too.
PAGE_FORMAT_STORAGE = "storage"  # rows in the storage dtype (WKV_PAGE_FORMAT_STORAGE = 0)
PAGE_FORMAT_INT8 = "int8"        # 8-bit rows with an f32 scale each (WKV_PAGE_FORMAT_INT8 = 1)
# ... with keys kept as differences from their clusters' centroids
# (WKV_PAGE_FORMAT_INT8_CENTERED = 2, 0.11)
PAGE_FORMAT_INT8_CENTERED = "int8-centered"
_PAGE_FORMATS = {PAGE_FORMAT_STORAGE: 0, PAGE_FORMAT_INT8: 1, PAGE_FORMAT_INT8_CENTERED: 2}
_PAGE_FORMAT_NAMES = {v: k for k, v in _PAGE_FORMATS.items()}

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_U64_FIELDS = ("host_budget_bytes", "host_chunk_bytes", "device_cache_bytes", "seed", "spill_budget_bytes")

StreamLike = Union[int, Any, None]
Tensor = Any  # an object with __dlpack__, __cuda_array_interface__ or __array_interface__


class _LibDefault:
    """Marks a Config field that takes the library's default."""

    def __repr__(self) -> str:
        return "<library default>"


_DEFAULT: Any = _LibDefault()


def _canonical_dtype(value: Any) -> str:
    name = str(value).lower()
    for prefix in ("torch.", "numpy.", "dtype(", "<class 'numpy."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.strip("'>)\"")
    if isinstance(value, int) and not isinstance(value, bool):
        for key, code in _DTYPES.items():
            if code == value:
                return key
    if name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    raise InvalidArgumentError(1, "dtype %r is not one of f32, f16, bf16" % (value,))


def _canonical_page_format(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value in _PAGE_FORMAT_NAMES:
        return _PAGE_FORMAT_NAMES[value]
    if isinstance(value, str) and value.lower() in _PAGE_FORMATS:
        return value.lower()
    raise InvalidArgumentError(1, "page_format %r is not one of storage (0), int8 (1), int8-centered (2)"
                               % (value,))


@dataclass
class Config:
    """Everything an engine is opened with (struct wkv_config).

    The model shape (n_layers, n_q_heads, n_kv_heads, head_dim) is required;
    every other field defaults to the library's default, read from
    wkv_config_init when the Config is made. ``device`` is "cpu", "cuda",
    "cuda:N" (which sets device_id) or "auto"; ``dtype`` is "f32", "f16" or
    "bf16" (aliases such as "float16" and torch/NumPy dtypes are accepted);
    ``page_format`` is "storage" (PAGE_FORMAT_STORAGE: rows in the dtype),
    "int8" (PAGE_FORMAT_INT8: 8-bit rows with an f32 scale each, libwavekv
    0.10 on) or "int8-centered" (PAGE_FORMAT_INT8_CENTERED: the same with keys
    kept less their clusters' centroids, libwavekv 0.11 on), or
    the C value 0, 1 or 2. Environment variables (WKV_THREADS,
    WKV_RETRIEVAL_FRAC, WKV_PAGE_FORMAT, ...) override fields when the engine
    opens; Engine.config shows the values in force.
    """

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str = _DEFAULT
    device: str = _DEFAULT
    device_id: int = _DEFAULT
    segment_tokens: int = _DEFAULT
    update_segment_tokens: int = _DEFAULT
    cluster_tokens: int = _DEFAULT
    kmeans_iters: int = _DEFAULT
    sink_tokens: int = _DEFAULT
    window_tokens: int = _DEFAULT
    retrieval_frac: float = _DEFAULT
    estimation_frac: float = _DEFAULT
    page_bytes: int = _DEFAULT
    threads: int = _DEFAULT
    flags: int = _DEFAULT
    host_budget_bytes: int = _DEFAULT
    host_chunk_bytes: int = _DEFAULT
    device_cache_bytes: int = _DEFAULT
    seed: int = _DEFAULT
    stats_path: Optional[str] = None
    stats_interval_ms: int = _DEFAULT
    method: int = _DEFAULT
    spill_dir: Optional[str] = None
    spill_budget_bytes: int = _DEFAULT
    page_format: str = _DEFAULT

    def __post_init__(self) -> None:
        defaults = Config._from_c(_init_config())
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is _DEFAULT:
                setattr(self, f.name, getattr(defaults, f.name, 0))
        if isinstance(self.device, str) and self.device.startswith("cuda:"):
            ordinal = self.device[len("cuda:"):]
            if not ordinal.isdigit():
                raise InvalidArgumentError(1, "device %r: expected cuda:N" % self.device)
            self.device, self.device_id = "cuda", int(ordinal)
        self.dtype = _canonical_dtype(self.dtype)
        self.page_format = _canonical_page_format(self.page_format)
        if isinstance(self.device, int) and self.device in _DEVICE_NAMES:
            self.device = _DEVICE_NAMES[self.device]
        if self.device not in _DEVICES:
            raise InvalidArgumentError(1, "device %r is not one of cpu, cuda, cuda:N, auto"
                                       % (self.device,))

    def to_c(self) -> _lib.WkvConfig:
        """The struct wkv_config of this configuration (size set by wkv_config_init)."""
        cfg = _init_config()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype":
                value = _DTYPES[_canonical_dtype(value)]
            elif f.name == "page_format":
                value = _PAGE_FORMATS[_canonical_page_format(value)]
            elif f.name in ("stats_path", "spill_dir"):
                if value is not None and not isinstance(value, (str, os.PathLike)):
                    raise InvalidArgumentError(1, "config.%s must be a path or None, not %r"
                                               % (f.name, value))
                # The struct keeps the bytes alive as long as it lives.
                value = None if value is None else os.fsencode(value)
            elif f.name == "device":
                value = _DEVICES[value]
            elif f.name in ("retrieval_frac", "estimation_frac"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise InvalidArgumentError(1, "config.%s must be a number, not %r"
                                               % (f.name, value))
                value = float(value)
            else:
                lo = -(1 << 31) if f.name == "device_id" else 0
                hi = (1 << 31) - 1 if f.name == "device_id" else \
                    _U64 if f.name in _U64_FIELDS else _U32
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise InvalidArgumentError(1, "config.%s must be an integer in [%d, %d], not %r"
                                               % (f.name, lo, hi, value))
            setattr(cfg, f.name, value)
        return cfg

    @classmethod
    def _from_c(cls, cfg: _lib.WkvConfig) -> "Config":
        values: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(cfg, f.name)
            if f.name == "dtype":
                value = {v: k for k, v in _DTYPES.items()}.get(value, value)
            elif f.name == "page_format":
                value = _PAGE_FORMAT_NAMES.get(value, value)
            elif f.name in ("stats_path", "spill_dir"):
                value = None if value is None else os.fsdecode(value)
            elif f.name == "device":
                value = _DEVICE_NAMES.get(value, value)
            elif isinstance(value, float):
                value = _short_float32(value)
            values[f.name] = value
        obj = cls.__new__(cls)
        obj.__dict__.update(values)
        return obj


def _short_float32(x: float) -> float:
    """The shortest decimal that is the same float32 as x (0.018, not
    0.017999999225139618)."""
    as_f32 = struct.unpack("f", struct.pack("f", x))[0]
    for digits in range(1, 10):
        y = float("%.*g" % (digits, x))
        if struct.unpack("f", struct.pack("f", y))[0] == as_f32:
            return y
    return x


def _init_config() -> _lib.WkvConfig:
    return _lib.init_struct(_lib.WkvConfig, "wkv_config_init")


@dataclass(frozen=True)
class Stats:
    """Statistics of one engine (struct wkv_stats); counters are totals since
    the engine opened."""

    device: str
    sequences: int
    tokens: int
    segments: int
    clusters: int
    host_bytes_reserved: int
    host_bytes_used: int
    host_budget_bytes: int
    page_bytes: int
    pages_used: int
    pages_free: int
    steady_bytes: int
    meta_bytes: int
    lookups: int
    retrieved_clusters: int
    estimated_clusters: int
    attended_tokens: int
    cache_hits: int
    cache_misses: int
    device_cache_bytes: int
    kmeans_ns: int
    cache_admissions: int
    cache_evictions: int
    manager_backlog: int
    pin_fallbacks: int
    spill_io: int             # WKV_SPILL_IO_* bits (1 io_uring, 2 O_DIRECT); 0 without a spill file
    spill_bytes_used: int
    spill_file_bytes: int
    spill_budget_bytes: int
    spill_bytes_written: int
    spill_bytes_read: int
    evicted_sequences: int
    spill_cold_pages: int     # pages of live sequences in the spill file (cold pages)
    spill_pages_written: int
    spill_pages_read: int
    spill_estimated: int      # retrievals estimated because a page was on disk
    spill_read_errors: int
    spill_write_errors: int
    cache_frames_given: int     # free device cache frames steps took from the pool for admissions (CUDA)
    cache_records_dropped: int  # steps with no access record (ring full): nothing admitted (CUDA)
    growths_deferred: int       # generated segments' growths begun and left to commit at their point
    growth_waits: int           # commits of such growths that waited for their clustering
    decode_graphs: int          # decoding steps run as a replay of their plan's CUDA graph (CUDA)
    device_bytes_reserved: int  # device memory the engine holds: its pool (at its peak), the cache (CUDA)
    device_bytes_used: int      # of it, allocated now (CUDA)
    meta_device_bytes: int      # of meta_bytes, the bytes in device memory (CUDA)
    meta_host_rows_reserved: int  # pinned host memory of the f32 meta rows' pool (CUDA, host meta rows)


@dataclass(frozen=True)
class SeqInfo:
    """What one layer of a sequence holds (struct wkv_seq_info)."""

    generating: bool  # the layer has had its first lookup
    tokens: int       # tokens appended to this layer
    clustered: int    # tokens in clustered segments
    sink: int         # tokens in the sink
    tail: int         # unclustered recent tokens, attended exactly
    segments: int     # clustered segments, per KV head
    clusters: int     # clusters summed over KV heads
    pages: int        # pages summed over KV heads
    evicted: bool     # the sequence is evicted (its pages in the spill file)
    spilled_pages: int  # pages in the spill file now: all while evicted, else its cold pages


_O = TypeVar("_O", bound="_Owner")


class _Owner:
    """Owns one handle: closes it once, refuses use after close, and refuses
    (StateError) a second thread entering while one is inside a call, where
    `exclusive` (sequences and plans: one thread at a time, per wavekv.h)."""

    _kind = "object"
    _destroy_name = ""

    def __init__(self, handle: int, exclusive: bool) -> None:
        self._handle: Optional[int] = handle
        self._lock = threading.Lock()
        self._exclusive = exclusive

    @property
    def closed(self) -> bool:
        """True once close() has run."""
        return self._handle is None

    def _enter(self, fn: str) -> int:
        if not self._lock.acquire(blocking=not self._exclusive):
            raise StateError(10, "%s: this %s is in use by another thread (a %s is used by "
                                 "one thread at a time)" % (fn, self._kind, self._kind))
        if self._handle is None:
            self._lock.release()
            raise InvalidHandleError(2, "%s: the %s is closed" % (fn, self._kind))
        return self._handle

    def _leave(self) -> None:
        self._lock.release()

    def close(self) -> None:
        """Releases the handle. Idempotent; every other method raises
        InvalidHandleError afterwards."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            getattr(_lib.lib(), self._destroy_name)(handle)

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A fallback only: close() or `with` is the deterministic way.
        try:
            if getattr(self, "_handle", None) is not None:
                self.close()
        except Exception:
            pass


def _c_path(path: Any, fn: str) -> bytes:
    """A path's bytes as the library takes them. ctypes passes bytes with a
    NUL inside as they are, so C would see the path cut short and open
    another file: refused here instead."""
    try:
        raw = os.fsencode(path)
    except TypeError:
        raise InvalidArgumentError(1, "%s: path must be a str, bytes or os.PathLike, not %r"
                                   % (fn, path)) from None
    if b"\0" in raw:
        raise InvalidArgumentError(1, "%s: the path %r has a NUL byte at %d"
                                   % (fn, path, raw.index(b"\0")))
    return raw


def _check_layer(layer: Any, fn: str) -> int:
    if isinstance(layer, bool):
        raise InvalidArgumentError(1, "%s: layer must be an int, not %r" % (fn, layer))
    try:
        index = operator.index(layer)
    except TypeError:
        raise InvalidArgumentError(1, "%s: layer must be an int, not %r" % (fn, layer)) from None
    if not 0 <= index <= _U32:
        raise OutOfRangeError(3, "%s: layer %d out of range" % (fn, index))
    return index


def _check_u32(value: Any, name: str, fn: str) -> int:
    """A count the C ABI takes as a uint32_t."""
    if isinstance(value, bool):
        raise InvalidArgumentError(1, "%s: %s must be an int, not %r" % (fn, name, value))
    try:
        count = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(1, "%s: %s must be an int, not %r" % (fn, name, value)) from None
    if not 0 <= count <= _U32:
        raise InvalidArgumentError(1, "%s: %s %d out of range (0 to %d)" % (fn, name, count, _U32))
    return count


class Engine(_Owner):
    """An engine: one device's KV storage (wkv_engine).

    ``Engine(Config(...))`` or ``Engine(n_layers=..., n_q_heads=..., ...)``.
    Use it as a context manager or call close(). Sequences and plans made from
    it keep working after it is closed (they keep its memory alive until the
    last of them is closed), as wavekv.h says. An engine may be used by several
    threads at once.
    """

    _kind = "engine"
    _destroy_name = "wkv_engine_close"

    def __init__(self, config: Optional[Config] = None, **fields: Any) -> None:
        if config is None:
            config = Config(**fields)
        elif fields:
            config = dataclasses.replace(config, **fields)
        cfg = config.to_c()
        since = _lib.PAGE_FORMAT_VALUE_SINCE.get(cfg.page_format, 0)
        if _lib.library_minor() < since:
            # An older library's reserved0 (or its page_format check) would
            # refuse it, naming a field or value the caller may not know.
            raise UnsupportedError(4, "Engine: page_format %s needs libwavekv 0.%d or later; the one loaded is %s"
                                   % (_PAGE_FORMAT_NAMES.get(cfg.page_format, cfg.page_format),
                                      since, _lib.lib().wkv_version_string().decode()))
        handle = ctypes.c_void_p()
        _lib.check(_lib.lib().wkv_engine_open(ctypes.byref(cfg), ctypes.byref(handle)))
        super().__init__(handle.value or 0, exclusive=False)
        try:
            self._config = self._read_config()
            dev = ctypes.c_uint32()
            _lib.check(_lib.lib().wkv_engine_device(self._handle, ctypes.byref(dev)))
            self._device = _DEVICE_NAMES.get(dev.value, str(dev.value))
        except BaseException:
            self.close()
            raise
        self._target = T.Target(
            dtype=_TENSOR_DTYPE[self._config.dtype],
            cuda=self._device == "cuda",
            device_id=int(self._config.device_id),
        )

    def _read_config(self) -> Config:
        cfg = _lib.init_struct(_lib.WkvConfig, "wkv_config_init")
        _lib.check(_lib.lib().wkv_engine_config(self._handle, ctypes.byref(cfg)))
        return Config._from_c(cfg)

    @property
    def config(self) -> Config:
        """The effective configuration (defaults and environment overrides
        resolved), as read when the engine opened."""
        return dataclasses.replace(self._config)

    @property
    def device(self) -> str:
        """The backend the engine runs on: "cpu" or "cuda"."""
        return self._device

    @property
    def dtype(self) -> str:
        """The dtype of K, V, q and outputs: "f32", "f16" or "bf16"."""
        return self._config.dtype

    def stats(self) -> Stats:
        """The engine's statistics (wkv_engine_stats)."""
        handle = self._enter("Engine.stats")
        try:
            st = _lib.init_struct(_lib.WkvStats, "wkv_stats_init")
            _lib.check(_lib.lib().wkv_engine_stats(handle, ctypes.byref(st)))
        finally:
            self._leave()
        values: Dict[str, Any] = {f.name: getattr(st, f.name) for f in dataclasses.fields(Stats)}
        values["device"] = _DEVICE_NAMES.get(st.device, str(st.device))
        return Stats(**values)

    def stats_json(self) -> Dict[str, Any]:
        """The engine's configuration and statistics as one parsed JSON object
        (wkv_engine_stats_json)."""
        handle = self._enter("Engine.stats_json")
        try:
            out = ctypes.c_void_p()
            _lib.check(_lib.lib().wkv_engine_stats_json(handle, ctypes.byref(out)))
        finally:
            self._leave()
        try:
            text = ctypes.string_at(out.value).decode("utf-8") if out.value else "{}"
        finally:
            _lib.lib().wkv_free(out)
        result: Dict[str, Any] = json.loads(text)
        return result

    def sequence(self) -> "Sequence":
        """Creates an empty sequence (wkv_seq_create)."""
        return Sequence(self)

    def plan(self) -> "Plan":
        """Creates a plan, the reusable state of decoding steps (wkv_plan_create)."""
        return Plan(self)

    def load(self, path: Union[str, "os.PathLike[str]"]) -> "Sequence":
        """A new sequence from a file that Sequence.save wrote (wkv_seq_load):
        all or nothing; CorruptError names a damaged section,
        InvalidArgumentError a shape that differs from the engine's."""
        handle = self._enter("Engine.load")
        try:
            out = ctypes.c_void_p()
            _lib.check(_lib.lib().wkv_seq_load(handle, _c_path(path, "Engine.load"),
                                               ctypes.byref(out)))
        finally:
            self._leave()
        return Sequence._adopt(self, out.value or 0)

    def _create(self, fn: str, create: str) -> int:
        handle = self._enter(fn)
        try:
            out = ctypes.c_void_p()
            _lib.check(getattr(_lib.lib(), create)(handle, ctypes.byref(out)))
        finally:
            self._leave()
        return out.value or 0

    def __repr__(self) -> str:
        c = self._config
        state = "closed" if self.closed else self._device
        return ("<wavekv.Engine %s %s layers=%d q_heads=%d kv_heads=%d head_dim=%d>"
                % (state, c.dtype, c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim))


def _stream_handle(stream: StreamLike, tensors: Iterable[Any], target: T.Target) -> int:
    """The cudaStream_t to use on a CUDA engine: the explicit argument, else
    the current stream of the first torch (or CuPy) tensor's framework, else
    torch's current stream if torch is imported, else the default stream (0)."""
    if not target.cuda:
        return 0
    if stream is not None:
        if isinstance(stream, bool):
            raise InvalidArgumentError(1, "stream must be an int or a stream object, not a bool")
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr", "handle"):
            value = getattr(stream, attr, None)
            if isinstance(value, int):
                return value
        raise InvalidArgumentError(1, "stream %r: expected a cudaStream_t as an int, a "
                                      "torch.cuda.Stream or a cupy Stream" % (stream,))
    for t in tensors:
        kind = T.framework(t)
        if kind == "torch" and getattr(t, "is_cuda", False):
            torch = sys.modules["torch"]
            return int(torch.cuda.current_stream(target.device_id).cuda_stream)
        if kind == "cupy":
            cupy = sys.modules["cupy"]
            return int(cupy.cuda.get_current_stream().ptr)
    return _torch_current_stream(target)


class _Checked:
    """Reads and checks the tensors of one call, keeping them alive until the
    call returns."""

    def __init__(self, fn: str, target: T.Target, stream: int) -> None:
        self.fn = fn
        self.target = target
        self.stream = stream

    def rows(self, obj: Tensor, name: str, shape: Tuple[Optional[int], int, int], names: str,
             writable: bool = False) -> Tuple[T.TensorView, int, int]:
        what = "%s: %s" % (self.fn, name)
        view = T.read(obj, what, self.stream)
        T.check_device(view, self.target, what)
        T.check_shape(view, shape, names, what)
        T.check_dtype(view, self.target.dtype, what)
        if writable:
            T.check_writable(view, obj, what)
        outer, inner = T.row_strides(view, what)
        return view, outer, inner

    def batch_rows(self, obj: Tensor, name: str, shape: Tuple[int, Optional[int], int, int],
                   names: str) -> Tuple[T.TensorView, int, int, int]:
        what = "%s: %s" % (self.fn, name)
        view = T.read(obj, what, self.stream)
        T.check_device(view, self.target, what)
        T.check_shape(view, shape, names, what)
        T.check_dtype(view, self.target.dtype, what)
        seq, outer, inner = T.batch_row_strides(view, what)
        return view, seq, outer, inner

    def lse(self, obj: Tensor, n_seqs: int, n_q_heads: int, packed: bool) -> Tuple[T.TensorView, int]:
        what = "%s: lse" % self.fn
        view = T.read(obj, what, self.stream)
        T.check_device(view, self.target, what)
        T.check_shape(view, (n_seqs, n_q_heads), "(n_seqs, n_q_heads)", what)
        T.check_dtype(view, "float32", what, "log-sum-exps are f32 whatever the engine's dtype")
        T.check_writable(view, obj, what)
        seq_stride = view.strides[0] if n_seqs > 1 else 0
        if n_q_heads > 1 and view.strides[1] != 1:
            raise InvalidArgumentError(1, "%s: the n_q_heads entries of a sequence must be "
                                          "contiguous; strides %s" % (what, view.strides))
        if n_seqs > 1 and (seq_stride < n_q_heads or (packed and seq_stride != n_q_heads)):
            raise InvalidArgumentError(1, "%s: strides %s; expected %s" % (
                what, view.strides, "a packed [n_seqs][n_q_heads] array" if packed
                else "rows of n_q_heads floats that do not overlap"))
        return view, seq_stride


def _c_stream(stream: int) -> Optional[int]:
    return stream or None


class Sequence(_Owner):
    """One request's context: its keys and values across all layers (wkv_seq).

    Made by Engine.sequence(). Used by one thread at a time: a call from a
    second thread while one is inside raises StateError.
    """

    _kind = "sequence"
    _destroy_name = "wkv_seq_destroy"

    def __init__(self, engine: Engine) -> None:
        """Creates an empty sequence in `engine` (same as engine.sequence())."""
        _Owner.__init__(self, engine._create("Engine.sequence", "wkv_seq_create"), exclusive=True)
        self._engine = engine
        self._config = engine._config
        self._target = engine._target

    @property
    def engine(self) -> Engine:
        """The engine the sequence was made from (possibly closed since)."""
        return self._engine

    def append(self, layer: int, k: Tensor, v: Tensor, stream: StreamLike = None) -> None:
        """Appends tokens' keys and values for one layer (wkv_seq_append).

        k and v are [n_tokens][n_kv_heads][head_dim] tensors in the engine's
        dtype and on its device, with the same strides (any that keep the
        head_dim elements of a row contiguous and rows apart). Keys are
        post-RoPE. Before the layer's first lookup (or end_prompt) the tokens
        are the prompt; after it, generated tokens. On a CUDA engine the copy is
        ordered on `stream` (default: torch's current stream for torch tensors)
        and the call may return before it completes.
        """
        fn = "Sequence.append"
        layer = _check_layer(layer, fn)
        c = self._config
        handle = self._enter(fn)
        try:
            s = _stream_handle(stream, (k, v), self._target)
            chk = _Checked(fn, self._target, s)
            shape = (None, c.n_kv_heads, c.head_dim)
            names = "(n_tokens, n_kv_heads, head_dim)"
            kt, ko, ki = chk.rows(k, "k", shape, names)
            vt, vo, vi = chk.rows(v, "v", shape, names)
            if kt.shape[0] != vt.shape[0]:
                raise InvalidArgumentError(1, "%s: k has %d tokens and v %d" % (
                    fn, kt.shape[0], vt.shape[0]))
            if (ko, ki) != (vo, vi):
                raise InvalidArgumentError(
                    1, "%s: k and v must have the same strides (the C ABI takes one pair); "
                    "k %s, v %s" % (fn, kt.strides, vt.strides))
            n = kt.shape[0]
            if n > _U32:
                raise InvalidArgumentError(1, "%s: %d tokens in one call; at most %d" % (fn, n, _U32))
            _lib.check(_lib.lib().wkv_seq_append(
                handle, layer, kt.ptr, vt.ptr, n, ko, ki, _c_stream(s)))
        finally:
            self._leave()

    @staticmethod
    def append_batch(seqs: Union["Sequence", Iterable["Sequence"]], layer: int, k: Tensor,
                     v: Tensor, stream: StreamLike = None) -> None:
        """Appends tokens' keys and values for one layer to each of several
        sequences of one engine, in one call (wkv_append_batch, ABI 0.5): on a
        CUDA engine one kernel writes every sequence's rows.

        k and v are [n_seqs][n_tokens][n_kv_heads][head_dim] tensors, n_seqs
        = len(seqs), in the engine's dtype and on its device, with the same
        strides: each sequence's [n_tokens][n_kv_heads][head_dim] as append
        takes it, the sequences any stride apart (interleaved by token, say).
        The usual decoding step, new K of shape [n_seqs][n_kv_heads][head_dim],
        is k[:, None]. Each sequence gets what append would give it; the
        stream is chosen as for append.

        The sequences must be distinct (InvalidArgumentError) and of one
        engine (InvalidHandleError). An error found before the copy appends
        nothing to any sequence; an error in the growth of sequence i
        (BudgetError, OutOfMemoryError; the message names i) leaves those
        before i with their new tokens and i and those after it without.
        """
        fn = "Sequence.append_batch"
        layer = _check_layer(layer, fn)
        seq_list, entered, arr = _enter_seqs(seqs, fn)
        try:
            first = seq_list[0]
            c, target = first._config, first._target
            n = len(seq_list)
            s = _stream_handle(stream, (k, v), target)
            chk = _Checked(fn, target, s)
            shape = (n, None, c.n_kv_heads, c.head_dim)
            names = "(n_seqs, n_tokens, n_kv_heads, head_dim)"
            kt, ks, ko, ki = chk.batch_rows(k, "k", shape, names)
            vt, vs, vo, vi = chk.batch_rows(v, "v", shape, names)
            if kt.shape[1] != vt.shape[1]:
                raise InvalidArgumentError(1, "%s: k has %d tokens and v %d" % (
                    fn, kt.shape[1], vt.shape[1]))
            if (ks, ko, ki) != (vs, vo, vi):
                raise InvalidArgumentError(
                    1, "%s: k and v must have the same strides (the C ABI takes one set); "
                    "k %s, v %s" % (fn, kt.strides, vt.strides))
            n_tokens = kt.shape[1]
            if n_tokens > _U32:
                raise InvalidArgumentError(1, "%s: %d tokens in one call; at most %d"
                                           % (fn, n_tokens, _U32))
            _lib.check(_lib.lib().wkv_append_batch(
                arr, n, layer, kt.ptr, vt.ptr, n_tokens, ks, ko, ki, _c_stream(s)))
        finally:
            for seq in entered:
                seq._leave()

    def end_prompt(self, layer: int, stream: StreamLike = None) -> None:
        """Ends the prompt of one layer, building its index now rather than at
        the first decoding step (wkv_seq_end_prompt). Waits for `stream`."""
        fn = "Sequence.end_prompt"
        layer = _check_layer(layer, fn)
        handle = self._enter(fn)
        try:
            s = _stream_handle(stream, (), self._target)
            _lib.check(_lib.lib().wkv_seq_end_prompt(handle, layer, _c_stream(s)))
        finally:
            self._leave()

    @classmethod
    def _adopt(cls, engine: Engine, handle: int) -> "Sequence":
        seq = cls.__new__(cls)
        _Owner.__init__(seq, handle, exclusive=True)
        seq._engine = engine
        seq._config = engine._config
        seq._target = engine._target
        return seq

    def save(self, path: Union[str, "os.PathLike[str]"], fsync: bool = True) -> None:
        """Saves the sequence to a file, whole or not at all (wkv_seq_save):
        written beside `path`, fsynced, renamed over it. fsync=False skips the
        fsyncs (tests, benchmarks). Engine.load reads it back."""
        handle = self._enter("Sequence.save")
        try:
            _lib.check(_lib.lib().wkv_seq_save(handle, _c_path(path, "Sequence.save"),
                                               0 if fsync else _lib.WKV_SAVE_NO_FSYNC))
        finally:
            self._leave()

    def evict(self) -> None:
        """Writes the sequence's pages to the engine's spill file and gives
        their host memory back (wkv_seq_evict; needs Config.spill_dir). Its
        next use, or restore(), reads them back."""
        handle = self._enter("Sequence.evict")
        try:
            _lib.check(_lib.lib().wkv_seq_evict(handle))
        finally:
            self._leave()

    def restore(self) -> None:
        """Reads an evicted sequence's pages back, checking every checksum
        (wkv_seq_restore); a sequence in memory is left as it is."""
        handle = self._enter("Sequence.restore")
        try:
            _lib.check(_lib.lib().wkv_seq_restore(handle))
        finally:
            self._leave()

    def info(self, layer: int) -> SeqInfo:
        """What one layer of the sequence holds (wkv_seq_info_get)."""
        fn = "Sequence.info"
        layer = _check_layer(layer, fn)
        handle = self._enter(fn)
        try:
            info = _lib.init_struct(_lib.WkvSeqInfo, "wkv_seq_info_init")
            _lib.check(_lib.lib().wkv_seq_info_get(handle, layer, ctypes.byref(info)))
        finally:
            self._leave()
        return SeqInfo(
            generating=bool(info.generating), tokens=info.tokens, clustered=info.clustered,
            sink=info.sink, tail=info.tail, segments=info.segments, clusters=info.clusters,
            pages=info.pages, evicted=bool(info.evicted), spilled_pages=info.spilled_pages)

    def __repr__(self) -> str:
        return "<wavekv.Sequence %s>" % ("closed" if self.closed else "open")


def _enter_seqs(seqs: Union["Sequence", Iterable["Sequence"]], fn: str
                ) -> Tuple[List["Sequence"], List["Sequence"], Any]:
    """Enters each sequence of a batch (the caller leaves them): (the list,
    the sequences entered, the C array of handles). A sequence listed twice
    is entered once and its handle passed twice, for the library to refuse."""
    seq_list = [seqs] if isinstance(seqs, Sequence) else list(seqs)
    if not seq_list:
        raise InvalidArgumentError(1, "%s: no sequences" % fn)
    for s in seq_list:
        if not isinstance(s, Sequence):
            raise InvalidArgumentError(1, "%s: seqs must hold wavekv.Sequence objects, not %r"
                                       % (fn, s))
    if len(seq_list) > _U32:
        raise InvalidArgumentError(1, "%s: %d sequences; at most %d" % (fn, len(seq_list), _U32))
    entered: List[Sequence] = []
    handles: List[int] = []
    try:
        seen = set()
        for s in seq_list:
            if id(s) in seen:
                handles.append(s._handle or 0)  # listed twice: the library says so
                continue
            seen.add(id(s))
            handles.append(s._enter(fn))
            entered.append(s)
    except BaseException:
        for s in entered:
            s._leave()
        raise
    return seq_list, entered, (ctypes.c_void_p * len(handles))(*handles)


def _torch_current_stream(target: T.Target) -> int:
    """torch's current stream on the engine's device, if torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None and target.cuda:
        try:
            if torch.cuda.is_initialized():
                return int(torch.cuda.current_stream(target.device_id).cuda_stream)
        except Exception:
            return 0
    return 0


class RawArray:
    """A view of memory the library owns, readable with numpy.asarray (CPU
    engine, ``__array_interface__``) or torch.as_tensor / cupy.asarray (CUDA
    engine, ``__cuda_array_interface__``). bfloat16 data shows as uint16 bit
    patterns. Valid until the plan's next lookup or assemble, or its close;
    asking for the interface after that raises StateError, but arrays made
    before then must not be used after it."""

    def __init__(self, plan: "Plan", generation: int, ptr: int, shape: Tuple[int, ...],
                 typestr: str, cuda: bool) -> None:
        self._plan = plan
        self._generation = generation
        self.ptr = ptr
        self.shape = shape
        self.typestr = typestr
        self._cuda = cuda

    def _interface(self) -> Dict[str, Any]:
        if self._plan.closed or self._plan._generation != self._generation:
            raise StateError(10, "this execution-buffer view is stale: its plan has been "
                                 "closed or has run another lookup or assemble")
        # Read-only on the host; consumers of the CUDA interface (torch)
        # refuse the flag, so there it is only documented.
        iface: Dict[str, Any] = {"shape": self.shape, "typestr": self.typestr,
                                 "data": (self.ptr, not self._cuda), "strides": None, "version": 3}
        if self._cuda:
            iface["stream"] = None
        return iface

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        if self._cuda:
            raise AttributeError("__array_interface__: this memory is on the GPU")
        return self._interface()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if not self._cuda:
            raise AttributeError("__cuda_array_interface__: this memory is on the host")
        return self._interface()


@dataclass(frozen=True)
class XBuf:
    """The plan's execution buffer, as laid out by assemble (wkv_xbuf_view).

    Ragged, one run of tokens per (sequence, KV head), run r = s * n_kv_heads + h;
    run r's tokens are offsets[r] .. offsets[r + 1] of k and v, each
    [n_tokens][head_dim]. On a CUDA engine n_tokens is the buffer's capacity
    (offsets[n_runs] is known on the device only).
    """

    n_runs: int
    n_tokens: int
    head_dim: int
    dtype: str
    k: RawArray
    v: RawArray
    offsets: RawArray


class Plan(_Owner):
    """The reusable state of decoding steps (wkv_plan).

    Made by Engine.plan(). Used by one thread at a time: a call from a second
    thread while one is inside raises StateError.
    """

    _kind = "plan"
    _destroy_name = "wkv_plan_destroy"

    def __init__(self, engine: Engine) -> None:
        """Creates a plan in `engine` (same as engine.plan())."""
        _Owner.__init__(self, engine._create("Engine.plan", "wkv_plan_create"), exclusive=True)
        self._engine = engine
        self._config = engine._config
        self._target = engine._target
        self._step: Optional[Tuple[int, Any]] = None  # (n_seqs, q) of the last lookup
        self._generation = 0  # bumped by lookups and assembles: xbuf views go stale

    @property
    def engine(self) -> Engine:
        """The engine the plan was made from (possibly closed since)."""
        return self._engine

    def _q_out(self, chk: _Checked, n: int, q: Tensor) -> Tuple[T.TensorView, int, int]:
        c = self._config
        return chk.rows(q, "q", (n, c.n_q_heads, c.head_dim), "(n_seqs, n_q_heads, head_dim)")

    def _out(self, chk: _Checked, n: int, out: Tensor) -> Tuple[T.TensorView, int, int]:
        c = self._config
        return chk.rows(out, "out", (n, c.n_q_heads, c.head_dim),
                        "(n_seqs, n_q_heads, head_dim)", writable=True)

    def _new_out(self, template: Any, n: int) -> Any:
        c = self._config
        return T.empty_like(template, (n, c.n_q_heads, c.head_dim), self._target.dtype, self._target)

    def decode(self, seqs: Union[Sequence, Iterable[Sequence]], layer: int, q: Tensor,
               out: Optional[Tensor] = None, stream: StreamLike = None) -> Tensor:
        """One decoding step of one layer for a batch of sequences: lookup,
        assemble, attend and update in one call (wkv_decode).

        q is [n_seqs][n_q_heads][head_dim] (post-RoPE); out, of the same shape,
        receives the attention output; when not given it is allocated with q's
        framework (numpy.empty, torch.empty, cupy.empty). Returns out.
        """
        fn = "Plan.decode"
        layer = _check_layer(layer, fn)
        handle = self._enter(fn)
        try:
            seq_list, entered, arr = _enter_seqs(seqs, fn)
            try:
                n = len(seq_list)
                s = _stream_handle(stream, (q, out), self._target)
                chk = _Checked(fn, self._target, s)
                qt, qo, qi = self._q_out(chk, n, q)
                if out is None:
                    out = self._new_out(q, n)
                ot, oo, oi = self._out(chk, n, out)
                self._generation += 1
                self._step = None
                _lib.check(_lib.lib().wkv_decode(handle, arr, n, layer, qt.ptr, qo, qi,
                                                 ot.ptr, oo, oi, _c_stream(s)))
                self._step = (n, q)
            finally:
                for seq in entered:
                    seq._leave()
        finally:
            self._leave()
        return out

    def lookup(self, seqs: Union[Sequence, Iterable[Sequence]], layer: int, q: Tensor,
               stream: StreamLike = None) -> None:
        """Scores the clusters and selects the retrieval and estimation zones
        for each sequence at one layer (wkv_lookup). q is
        [n_seqs][n_q_heads][head_dim], copied by the call."""
        fn = "Plan.lookup"
        layer = _check_layer(layer, fn)
        handle = self._enter(fn)
        try:
            seq_list, entered, arr = _enter_seqs(seqs, fn)
            try:
                n = len(seq_list)
                s = _stream_handle(stream, (q,), self._target)
                chk = _Checked(fn, self._target, s)
                qt, qo, qi = self._q_out(chk, n, q)
                self._generation += 1
                self._step = None
                _lib.check(_lib.lib().wkv_lookup(handle, arr, n, layer, qt.ptr, qo, qi,
                                                 _c_stream(s)))
                self._step = (n, q)
            finally:
                for seq in entered:
                    seq._leave()
        finally:
            self._leave()

    def assemble(self, stream: StreamLike = None) -> None:
        """Lays out the exact part of the step in the execution buffer
        (wkv_assemble). Requires a lookup."""
        fn = "Plan.assemble"
        handle = self._enter(fn)
        try:
            s = _stream_handle(stream, (), self._target)
            self._generation += 1
            _lib.check(_lib.lib().wkv_assemble(handle, _c_stream(s)))
        finally:
            self._leave()

    def xbuf(self) -> XBuf:
        """The execution buffer laid out by the last assemble (wkv_plan_xbuf)."""
        fn = "Plan.xbuf"
        handle = self._enter(fn)
        try:
            view = _lib.init_struct(_lib.WkvXbufView, "wkv_xbuf_view_init")
            _lib.check(_lib.lib().wkv_plan_xbuf(handle, ctypes.byref(view)))
            gen = self._generation
        finally:
            self._leave()
        dtype = {0: "f32", 1: "f16", 2: "bf16"}.get(view.dtype, str(view.dtype))
        typestr = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}.get(dtype, "|V%d" % 2)
        cuda = self._target.cuda
        rows = (int(view.n_tokens), int(view.head_dim))
        return XBuf(
            n_runs=int(view.n_runs), n_tokens=int(view.n_tokens), head_dim=int(view.head_dim),
            dtype=dtype,
            k=RawArray(self, gen, view.k or 0, rows, typestr, cuda),
            v=RawArray(self, gen, view.v or 0, rows, typestr, cuda),
            offsets=RawArray(self, gen, view.offsets or 0, (int(view.n_runs) + 1,), "<i4", cuda),
        )

    def _step_or_raise(self, fn: str) -> Tuple[int, Any]:
        if self._step is None:
            raise StateError(10, "%s: the plan holds no step: call lookup (and assemble) first"
                             % fn)
        return self._step

    def attend(self, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
               stream: StreamLike = None) -> Tensor:
        """Exact attention over the execution buffer merged with the estimate
        (wkv_attend). out is [n_seqs][n_q_heads][head_dim] (allocated like the
        lookup's q when not given); lse, if given, a packed float32
        [n_seqs][n_q_heads] array that receives the log-sum-exp. Returns out."""
        fn = "Plan.attend"
        handle = self._enter(fn)
        try:
            n, q = self._step_or_raise(fn)
            s = _stream_handle(stream, (out, lse, q), self._target)
            chk = _Checked(fn, self._target, s)
            if out is None:
                out = self._new_out(q, n)
            ot, oo, oi = self._out(chk, n, out)
            lse_ptr = None
            if lse is not None:
                lt, _ = chk.lse(lse, n, self._config.n_q_heads, packed=True)
                lse_ptr = lt.ptr
            _lib.check(_lib.lib().wkv_attend(handle, ot.ptr, oo, oi, lse_ptr, _c_stream(s)))
        finally:
            self._leave()
        return out

    def merge(self, out: Tensor, lse: Tensor, stream: StreamLike = None) -> None:
        """Folds the estimate into an output attended by the caller over the
        execution buffer (wkv_merge). out ([n_seqs][n_q_heads][head_dim]) and
        lse (float32 [n_seqs][n_q_heads], natural log-sum-exp of scaled scores)
        are updated in place."""
        fn = "Plan.merge"
        handle = self._enter(fn)
        try:
            n, _q = self._step_or_raise(fn)
            s = _stream_handle(stream, (out, lse), self._target)
            chk = _Checked(fn, self._target, s)
            ot, oo, oi = self._out(chk, n, out)
            lt, ls = chk.lse(lse, n, self._config.n_q_heads, packed=False)
            _lib.check(_lib.lib().wkv_merge(handle, ot.ptr, oo, oi, lt.ptr, ls, _c_stream(s)))
        finally:
            self._leave()

    def update(self, stream: StreamLike = None) -> None:
        """Hands the step's access record to the buffer manager (wkv_update)."""
        self._on_stream("Plan.update", _lib.lib().wkv_update, stream)

    def _on_stream(self, fn: str, verb, stream: StreamLike) -> None:
        """Calls verb(plan, stream), a C function of the plan and a stream,
        with the plan entered (`fn` names the method in errors)."""
        handle = self._enter(fn)
        try:
            s = _stream_handle(stream, (), self._target)
            _lib.check(verb(handle, _c_stream(s)))
        finally:
            self._leave()

    def bind(self, seqs: Union[Sequence, Iterable[Sequence]], max_steps: int = 0,
             stream: StreamLike = None) -> None:
        """Binds the plan to a batch for a decoding step that a runtime
        captures into a CUDA graph of its own and replays, each replay after a
        prepare() (wkv_plan_bind, ABI 0.9).

        seqs are distinct sequences of the plan's engine, every layer holding
        tokens (bind after the prompts), in the order the captured
        Sequence.append_batch and decode calls will list them; max_steps is
        the number of tokens each may still take (0: 4096). Waits for
        `stream`. CUDA engines without cold pages only: a CPU engine raises
        UnsupportedError. While bound, the sequences refuse every other
        append, lookup, end_prompt, save and evict, and the plan every other
        step (StateError), until unbind().
        """
        fn = "Plan.bind"
        max_steps = _check_u32(max_steps, "max_steps", fn)
        bind = _lib.function("wkv_plan_bind", fn)
        handle = self._enter(fn)
        try:
            seq_list, entered, arr = _enter_seqs(seqs, fn)
            try:
                s = _stream_handle(stream, (), self._target)
                self._generation += 1  # the plan's buffers may be reserved anew
                _lib.check(bind(handle, arr, len(seq_list), max_steps, _c_stream(s)))
                self._step = None
            finally:
                for seq in entered:
                    seq._leave()
        finally:
            self._leave()

    def prepare(self, stream: StreamLike = None) -> None:
        """Prepares the next replay of the bound plan's captured step
        (wkv_plan_prepare, ABI 0.9): call it, then launch the graph once on
        the same `stream`. Raises StateError when the plan is not bound,
        nothing is captured or the device found a fault, BudgetError once
        max_steps steps are prepared; after an error the graph must not be
        launched for the step."""
        fn = "Plan.prepare"
        self._on_stream(fn, _lib.function("wkv_plan_prepare", fn), stream)

    def unbind(self, stream: StreamLike = None) -> None:
        """Ends the binding (wkv_plan_unbind, ABI 0.9): waits for `stream`
        (the replays'), takes back the tokens of steps prepared and never
        replayed, and frees the sequences and the plan for other use; a graph
        captured under the binding faults if replayed later. Raises
        StateError when the plan is not bound. close() unbinds a bound plan,
        waiting for the whole device."""
        fn = "Plan.unbind"
        self._on_stream(fn, _lib.function("wkv_plan_unbind", fn), stream)

    def close(self) -> None:
        """Releases the plan (wkv_plan_destroy); a bound plan is unbound first,
        which waits for the whole device. Idempotent."""
        self._step = None
        super().close()

    def __repr__(self) -> str:
        return "<wavekv.Plan %s>" % ("closed" if self.closed else "open")
