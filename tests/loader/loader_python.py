"""libwavekv loaded through ctypes into a Python process whose C++ runtime is
already loaded privately and in use (NumPy's, when NumPy is installed, and
libstdc++ opened with RTLD_LOCAL in any case, as extension modules bring it
in). Error paths and wkv_engine_stats_json must work there, and loading
it maps no cuBLAS.

    python3 loader_python.py LIBWAVEKV
"""
import ctypes
import json
import sys

try:
    import numpy  # noqa: F401  (its C++ runtime comes first when present)
    have_numpy = True
except ImportError:
    have_numpy = False

stdcxx = ctypes.CDLL("libstdc++.so.6")  # RTLD_LOCAL, like an extension module
cxx_new = stdcxx._Znwm
cxx_new.restype = ctypes.c_void_p
cxx_new.argtypes = [ctypes.c_size_t]
cxx_delete = stdcxx._ZdlPv
cxx_delete.argtypes = [ctypes.c_void_p]
before = cxx_new(1000)

lib = ctypes.CDLL(sys.argv[1])
lib.wkv_last_error.restype = ctypes.c_char_p
lib.wkv_config_init.argtypes = [ctypes.c_void_p]
lib.wkv_engine_open.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.wkv_engine_close.argtypes = [ctypes.c_void_p]
lib.wkv_engine_stats_json.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.wkv_free.argtypes = [ctypes.c_void_p]

# wkv_config's leading fields: size, device, device_id, n_layers, n_q_heads,
# n_kv_heads, head_dim, dtype (uint32 each), in a buffer larger than the
# struct so that the layout's tail does not matter here.
cfg = (ctypes.c_uint32 * 64)()
lib.wkv_config_init(cfg)
cfg[3], cfg[4], cfg[5], cfg[6], cfg[7] = 1, 4, 3, 64, 0  # 4 q heads over 3 kv heads
engine = ctypes.c_void_p()
failures = []
for _ in range(50):
    rc = lib.wkv_engine_open(cfg, ctypes.byref(engine))
    msg = lib.wkv_last_error().decode()
    if rc != 1 or "n_kv_heads" not in msg:
        failures.append(f"bad shape: rc {rc}, message {msg!r}")
        break
cfg[5] = 2
rc = lib.wkv_engine_open(cfg, ctypes.byref(engine))
if rc != 0:
    failures.append(f"open: rc {rc}: {lib.wkv_last_error().decode()}")
else:
    for _ in range(50):
        out = ctypes.c_void_p()
        rc = lib.wkv_engine_stats_json(engine, ctypes.byref(out))
        text = ctypes.string_at(out.value).decode()
        lib.wkv_free(out)
        if rc != 0 or json.loads(text)["config"]["n_kv_heads"] != 2:
            failures.append(f"stats_json: rc {rc}: {text[:80]}")
            break
    lib.wkv_engine_close(engine)
cxx_delete(before)
# cuBLAS serves one k-means path the engine never takes and is opened only
# there: a process that loads libwavekv and runs a CPU engine maps none of it
# (linked, it cost every such process about 0.2 s and 200 MB resident).
with open("/proc/self/maps") as maps:
    cublas = sorted({line.split()[-1] for line in maps if "libcublas" in line})
if cublas:
    failures.append(f"libwavekv brought in cuBLAS: {cublas}")
if failures:
    print("\n".join(failures))
    sys.exit(1)
print("loader_python: libwavekv loaded by ctypes beside a private C++ runtime"
      + (" and NumPy" if have_numpy else " (NumPy not installed)") + ": all checks passed")
