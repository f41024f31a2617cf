"""Reading tensors without copying them: DLPack capsules and the array
interfaces, and the checks that a tensor fits what the C ABI takes.

A tensor is read through, in this order:

1. ``__dlpack__`` / ``__dlpack_device__`` (NumPy, PyTorch, CuPy, JAX): the
   capsule's DLManagedTensor (or DLManagedTensorVersioned) is read in place.
   The capsule is not consumed: it is kept alive until the call into the
   library returns and then dropped, and its destructor (the producer's) calls
   the deleter, as the DLPack spec provides for an unconsumed capsule.
2. ``__cuda_array_interface__`` (CUDA) or ``__array_interface__`` (host), for
   objects without DLPack or whose DLPack export refused (a read-only NumPy
   array before NumPy 2.1, NumPy arrays of ml_dtypes' bfloat16).

Nothing is ever copied: a tensor that does not fit is refused with
InvalidArgumentError, naming the function, the argument and what was wrong.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from .errors import InvalidArgumentError

# DLDeviceType values (dlpack.h)
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_CUDA_MANAGED = 13
_DEVICE_NAMES = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
    9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
    14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia",
}

# DLDataTypeCode values
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_COMPLEX, _KDL_BOOL = 0, 1, 2, 4, 5, 6
_DTYPE_CODES = {_KDL_INT: "int", _KDL_UINT: "uint", _KDL_FLOAT: "float",
                _KDL_BFLOAT: "bfloat", _KDL_COMPLEX: "complex", _KDL_BOOL: "bool"}

DLPACK_FLAG_READ_ONLY = 1 << 0
DLPACK_FLAG_IS_COPIED = 1 << 1

# Element sizes of the dtypes the engine takes.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@dataclass
class TensorView:
    """Where a tensor's elements are, without owning them."""

    ptr: int                    # address of element [0, 0, ...] (byte_offset added)
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]    # in elements
    dtype: str                  # "float32", "float16", "bfloat16", or another name
    device_type: int            # DLDeviceType
    device_id: Optional[int]    # None: not known (__cuda_array_interface__)
    readonly: bool
    keep: Any                   # what must stay alive while ptr is used

    @property
    def device(self) -> str:
        name = _DEVICE_NAMES.get(self.device_type, "device type %d" % self.device_type)
        if self.device_id is None or self.device_type == KDL_CPU:
            return name
        return "%s:%d" % (name, self.device_id)


def framework(obj: Any) -> str:
    """The top-level module of a tensor's type: "numpy", "torch", "cupy", "jax"..."""
    module = type(obj).__module__ or ""
    top = module.split(".", 1)[0]
    return "jax" if top == "jaxlib" else top


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _dtype_name(code: int, bits: int, lanes: int) -> str:
    if lanes != 1:
        return "%s%dx%d" % (_DTYPE_CODES.get(code, "code%d" % code), bits, lanes)
    if code == _KDL_BFLOAT and bits == 16:
        return "bfloat16"
    return "%s%d" % (_DTYPE_CODES.get(code, "code%d" % code), bits)


def _from_capsule(capsule: Any, what: str) -> TensorView:
    name = _capsule_get_name(capsule)
    flags = 0
    if name == b"dltensor_versioned":
        addr = _capsule_get_pointer(capsule, name)
        managed_v = _DLManagedTensorVersioned.from_address(addr)
        if managed_v.version.major != 1:
            raise InvalidArgumentError(
                1, "%s: DLPack version %d.%d is not supported (1.x is)"
                % (what, managed_v.version.major, managed_v.version.minor))
        flags = int(managed_v.flags)
        t = managed_v.dl_tensor
    elif name == b"dltensor":
        addr = _capsule_get_pointer(capsule, name)
        t = _DLManagedTensor.from_address(addr).dl_tensor
    else:
        raise InvalidArgumentError(1, "%s: __dlpack__ returned a capsule named %r, not a "
                                      "DLPack tensor" % (what, name))
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) for i in range(ndim))
    else:
        strides = _contiguous_strides(shape)
    dtype = _dtype_name(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    if flags & DLPACK_FLAG_IS_COPIED:
        raise InvalidArgumentError(1, "%s: the producer copied the tensor for DLPack; "
                                      "wavekv reads and writes tensors in place" % what)
    return TensorView(
        ptr=(t.data or 0) + int(t.byte_offset),
        shape=shape,
        strides=strides,
        dtype=dtype,
        device_type=int(t.device.device_type),
        device_id=int(t.device.device_id),
        readonly=bool(flags & DLPACK_FLAG_READ_ONLY),
        keep=capsule,
    )


_TYPESTR = {"f4": "float32", "f2": "float16", "f8": "float64", "i4": "int32",
            "i8": "int64", "u2": "uint16", "u1": "uint8", "i2": "int16"}


def _from_array_interface(obj: Any, iface: Dict[str, Any], what: str, cuda: bool) -> TensorView:
    typestr = str(iface.get("typestr", ""))
    order, code = typestr[:1], typestr[1:]
    if order == ">":
        raise InvalidArgumentError(1, "%s: big-endian data (%s) is not supported" % (what, typestr))
    dtype = _TYPESTR.get(code, typestr)
    if code == "V2":
        # NumPy arrays of ml_dtypes' bfloat16 say only "2 bytes" here.
        dt = getattr(obj, "dtype", None)
        if getattr(dt, "name", None) == "bfloat16":
            dtype = "bfloat16"
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise InvalidArgumentError(1, "%s: the array interface gives no data pointer" % what)
    ptr, readonly = int(data[0] or 0), bool(data[1])
    shape = tuple(int(n) for n in iface.get("shape", ()))
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        itemsize = int(code[1:]) if code[1:].isdigit() else 1
    byte_strides = iface.get("strides")
    if byte_strides is None:
        strides = _contiguous_strides(shape)
    else:
        if any(int(s) % itemsize for s in byte_strides):
            raise InvalidArgumentError(
                1, "%s: strides %s (bytes) are not multiples of the element size %d"
                % (what, tuple(byte_strides), itemsize))
        strides = tuple(int(s) // itemsize for s in byte_strides)
    ptr += int(iface.get("offset", 0) or 0)
    return TensorView(
        ptr=ptr,
        shape=shape,
        strides=strides,
        dtype=dtype,
        device_type=KDL_CUDA if cuda else KDL_CPU,
        device_id=None if cuda else 0,
        readonly=readonly,
        keep=obj,
    )


def dlpack_stream(device_type: int, stream: int) -> Optional[int]:
    """The `stream` argument of __dlpack__ for a consumer working on `stream`
    (a cudaStream_t as an int; 0 = the default stream)."""
    if device_type in (KDL_CUDA, KDL_CUDA_MANAGED, 10):  # CUDA, managed, ROCm
        # 0 is disallowed by the spec: the legacy default stream is 1.
        return stream if stream else 1
    return None


def read(obj: Any, what: str, stream: int = 0) -> TensorView:
    """Where obj's elements are, without copying. `stream` is the stream the
    library will use (the producer orders its work before it)."""
    if framework(obj) == "torch" and getattr(obj, "requires_grad", False):
        obj = obj.detach()  # a view of the same storage; DLPack refuses otherwise
    dlpack = getattr(obj, "__dlpack__", None)
    refused: Optional[BaseException] = None
    if dlpack is not None:
        device_type = KDL_CPU
        get_device = getattr(obj, "__dlpack_device__", None)
        if get_device is not None:
            device_type = int(get_device()[0])
        s = dlpack_stream(device_type, stream)
        try:
            try:
                capsule = dlpack(stream=s, max_version=(1, 0))
            except TypeError:
                capsule = dlpack(stream=s) if s is not None else dlpack()
        except (BufferError, RuntimeError, ValueError, TypeError) as exc:
            refused = exc
        else:
            return _from_capsule(capsule, what)
    cuda_iface = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cuda_iface, dict):
        return _from_array_interface(obj, cuda_iface, what, cuda=True)
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict):
        return _from_array_interface(obj, iface, what, cuda=False)
    if refused is not None:
        raise InvalidArgumentError(1, "%s: its __dlpack__ refused to export it: %s" % (what, refused))
    raise InvalidArgumentError(
        1, "%s: a %s.%s is not a tensor: pass an object with __dlpack__ or an array "
        "interface (NumPy, PyTorch, CuPy, JAX)" % (what, type(obj).__module__, type(obj).__name__))


@dataclass(frozen=True)
class Target:
    """What the engine takes: its dtype and device."""

    dtype: str          # "float32", "float16" or "bfloat16"
    cuda: bool
    device_id: int

    @property
    def device(self) -> str:
        return "cuda:%d" % self.device_id if self.cuda else "cpu"


def check_device(t: TensorView, target: Target, what: str) -> None:
    if target.cuda:
        ok = t.device_type == KDL_CUDA and (t.device_id is None or t.device_id == target.device_id)
    else:
        ok = t.device_type in (KDL_CPU, KDL_CUDA_HOST)
    if not ok:
        raise InvalidArgumentError(
            1, "%s is on %s; this engine takes tensors on %s" % (what, t.device, target.device))


def check_dtype(t: TensorView, dtype: str, what: str, why: str = "the engine's dtype") -> None:
    if t.dtype != dtype:
        raise InvalidArgumentError(
            1, "%s has dtype %s; expected %s (%s; nothing is converted)"
            % (what, t.dtype, dtype, why))
    if t.ptr % ITEMSIZE[dtype]:
        raise InvalidArgumentError(1, "%s: address 0x%x is not aligned to its %d-byte elements"
                                   % (what, t.ptr, ITEMSIZE[dtype]))


def check_shape(t: TensorView, expected: Sequence[Optional[int]], names: str, what: str) -> None:
    """expected: one size per dimension, None where any positive size fits."""
    ok = len(t.shape) == len(expected) and all(
        (e is None and n > 0) or n == e for n, e in zip(t.shape, expected))
    if not ok:
        want = "(%s)" % ", ".join("%s" % ("*" if e is None else e) for e in expected)
        raise InvalidArgumentError(1, "%s has shape %s; expected %s = %s"
                                   % (what, tuple(t.shape), names, want))


def row_strides(t: TensorView, what: str) -> Tuple[int, int]:
    """The (outer, inner) strides in elements of a [outer][inner][head_dim]
    tensor, as the C ABI takes them (0 where a dimension has one entry, so
    that the library's packed default applies), after checking that the
    head_dim elements of a row are contiguous and that rows do not overlap
    (the library's rule)."""
    n_outer, n_inner, d = t.shape
    s_outer, s_inner, s_elem = t.strides
    if s_elem != 1 and d > 1:
        raise InvalidArgumentError(
            1, "%s: the elements of a row must be contiguous (stride 1), not %d apart; "
            "strides %s" % (what, s_elem, tuple(t.strides)))
    outer = s_outer if n_outer > 1 else 0
    inner = s_inner if n_inner > 1 else 0
    if outer < 0 or inner < 0:
        raise InvalidArgumentError(1, "%s: negative strides %s are not supported"
                                   % (what, tuple(t.strides)))
    dims = sorted((s, n) for s, n in ((outer, n_outer), (inner, n_inner)) if n > 1)
    if dims:
        small_stride, small_n = dims[0]
        overlap = small_stride < d
        if len(dims) == 2 and dims[1][0] < small_stride * small_n:
            overlap = True
        if overlap:
            raise InvalidArgumentError(
                1, "%s: strides %s make rows of %d elements overlap"
                % (what, tuple(t.strides), d))
    return outer, inner


def batch_row_strides(t: TensorView, what: str) -> Tuple[int, int, int]:
    """The (seq, outer, inner) strides in elements of a
    [n_seqs][outer][inner][head_dim] tensor, as wkv_append_batch takes them:
    each sequence's [outer][inner][head_dim] checked as row_strides checks
    it, and the sequence stride passed as it is (0 where there is one
    sequence). Sequences may overlap (the library only reads them), but a
    stride of 0 over several sequences (a broadcast) cannot be said: the
    C ABI reads 0 as packed."""
    n_seqs, s_seq = t.shape[0], t.strides[0]
    inner_view = TensorView(ptr=t.ptr, shape=tuple(t.shape[1:]), strides=tuple(t.strides[1:]),
                            dtype=t.dtype, device_type=t.device_type, device_id=t.device_id,
                            readonly=t.readonly, keep=t.keep)
    outer, inner = row_strides(inner_view, what)
    if n_seqs <= 1:
        return 0, outer, inner
    if s_seq < 0:
        raise InvalidArgumentError(1, "%s: negative strides %s are not supported"
                                   % (what, tuple(t.strides)))
    if s_seq == 0:
        raise InvalidArgumentError(
            1, "%s: strides %s repeat one sequence's rows for every sequence (a broadcast), "
            "which the C ABI cannot express (its seq_stride 0 means packed)"
            % (what, tuple(t.strides)))
    return s_seq, outer, inner


def check_writable(t: TensorView, obj: Any, what: str) -> None:
    if t.readonly or framework(obj) == "jax":
        raise InvalidArgumentError(1, "%s is read-only; wavekv writes its result there" % what)
    flags = getattr(obj, "flags", None)
    if flags is not None and getattr(flags, "writeable", True) is False:
        raise InvalidArgumentError(1, "%s is read-only; wavekv writes its result there" % what)


def empty_like(template: Any, shape: Tuple[int, ...], dtype: str, target: Target) -> Any:
    """A new uninitialised tensor of the template's framework (for outputs)."""
    kind = framework(template)
    if kind == "torch":
        torch = importlib.import_module("torch")
        tdtype = {"float32": torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16}[dtype]
        return torch.empty(shape, dtype=tdtype, device=template.device)
    if kind == "cupy":
        cupy = importlib.import_module("cupy")
        with cupy.cuda.Device(target.device_id):
            return cupy.empty(shape, dtype=template.dtype if dtype == "bfloat16" else dtype)
    if not target.cuda:
        numpy = importlib.import_module("numpy")
        np_dtype = getattr(template, "dtype", None)
        if dtype != "bfloat16" or getattr(np_dtype, "name", None) != "bfloat16":
            np_dtype = dtype
        try:
            return numpy.empty(shape, dtype=np_dtype)
        except TypeError:
            raise InvalidArgumentError(
                1, "cannot allocate a %s output with NumPy; pass out=" % dtype) from None
    raise InvalidArgumentError(
        1, "cannot allocate an output on %s for a %s tensor; pass out=" % (target.device, kind))
