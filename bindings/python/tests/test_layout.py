"""The ctypes structs match wavekv.h: a C program compiled against the header
prints every field's offset and size, and each struct's size."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from wavekv import _lib

STRUCTS = {
    "wkv_config": _lib.WkvConfig,
    "wkv_stats": _lib.WkvStats,
    "wkv_seq_info": _lib.WkvSeqInfo,
    "wkv_xbuf_view": _lib.WkvXbufView,
}


def _compiler() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    pytest.skip("no C compiler (cc, gcc, clang or $CC) to check the struct layouts against")
    raise AssertionError  # unreachable


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict:
    header = REPO_ROOT / "include" / "wavekv" / "wavekv.h"
    if not header.is_file():
        pytest.skip("wavekv.h not found at %s (not a checkout)" % header)
    cc = _compiler()
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <wavekv/wavekv.h>",
             "int main(void) {"]
    for name, cls in STRUCTS.items():
        lines.append('  printf("%s %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('  printf("%s.%s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (name, field, name, field, name, field))
    lines += ["  return 0;", "}"]
    tmp = Path(tmp_path_factory.mktemp("layout"))
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run(cc.split() + ["-std=c99", "-I", str(REPO_ROOT / "include"), str(src),
                                 "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout = {}
    for line in out.splitlines():
        key, *nums = line.split()
        layout[key] = tuple(int(n) for n in nums)
    return layout


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_struct_matches_header(c_layout: dict, name: str) -> None:
    cls = STRUCTS[name]
    assert (ctypes.sizeof(cls),) == c_layout[name], "sizeof(%s)" % name
    for field, ctype in cls._fields_:
        desc = getattr(cls, field)
        assert (desc.offset, desc.size) == c_layout["%s.%s" % (name, field)], \
            "%s.%s: ctypes (offset, size) differ from C" % (name, field)


def test_every_header_field_is_declared(c_layout: dict) -> None:
    # Fields present in C but missing in ctypes would leave a gap or shorten
    # the struct: the sizes must add up to sizeof with no hole left unnamed.
    header = (REPO_ROOT / "include" / "wavekv" / "wavekv.h").read_text()
    for name, cls in STRUCTS.items():
        body = header.split("typedef struct %s {" % name, 1)[1].split("} %s;" % name, 1)[0]
        declared = [f for f, _ in cls._fields_]
        # Comments go first, whole: a ';' inside one (on any of its lines)
        # is not the end of a field.
        code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", body, flags=re.S))
        for decl in code.split(";"):
            if not decl.strip():
                continue
            # "uint32_t a, b[4], *c": every declarator names a field.
            first, *more = decl.split(",")
            for declarator in [first.split()[-1]] + more:
                field = declarator.strip().lstrip("*").split("[", 1)[0].strip()
                assert field in declared, "%s.%s is in wavekv.h but not in the binding" % (name, field)


def test_init_functions_set_size() -> None:
    lib = _lib.lib()
    for name, cls in STRUCTS.items():
        obj = cls()
        getattr(lib, {"wkv_config": "wkv_config_init", "wkv_stats": "wkv_stats_init",
                      "wkv_seq_info": "wkv_seq_info_init",
                      "wkv_xbuf_view": "wkv_xbuf_view_init"}[name])(ctypes.byref(obj))
        assert obj.size == ctypes.sizeof(cls), name
