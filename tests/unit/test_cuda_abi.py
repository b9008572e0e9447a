"""The Python side of the kernels' binary interface against the CUDA sources, parsed as text (CPU only, no
CuPy): the NVLink context block and constants (moonep/backends/nvlink_abi.py vs csrc/common.cuh), the
planner's flags, cfg bits and workspace layout (moonep/planner/cuda.py vs csrc/planner.cu, csrc/layout.cu),
and the kernels each program of moonep/cuda_runtime.py loads."""
import re

import pytest

from moonep import cuda_runtime
from moonep.backends import nvlink_abi as abi
from moonep.planner import cuda as pcuda

CSRC = cuda_runtime.csrc_dir()


def _text(name):
    src = (CSRC / name).read_text()
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _defines(name):
    """#define NAME <integer> of a file (expressions of integers only)."""
    out = {}
    for m in re.finditer(r"^\s*#define\s+(\w+)\s+([-+*()<>\d\sxXa-fA-FuUlL|]+?)\s*$", _text(name), re.M):
        expr = re.sub(r"(?<=[\dA-Fa-f])[uUlL]+\b", "", m.group(2).strip())
        try:
            out[m.group(1)] = int(eval(expr, {}))  # noqa: S307 - integer literals from our own sources
        except (SyntaxError, NameError, TypeError):
            pass
    return out


def _struct_fields(name, struct):
    """[(field, count)] of a struct whose fields are all 8 bytes, in order."""
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", _text(name), re.S).group(1)
    consts = _defines(name)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(i64|u64|char|int|long long)\s*(\*?)\s*(.*)", decl, re.S)
        assert m, decl
        for d in m.group(3).split(","):
            dm = re.fullmatch(r"\s*(\*?)\s*(\w+)\s*(?:\[(\w+)\])?\s*", d)
            assert dm, d
            pointer = bool(m.group(2) or dm.group(1))
            assert pointer or m.group(1) in ("i64", "u64", "long long"), f"{dm.group(2)}: not 8 bytes"
            n = dm.group(3)
            fields.append((dm.group(2), 1 if n is None else (int(n) if n.isdigit() else consts[n])))
    return fields


def test_ctx_struct_matches_declaration():
    assert _struct_fields("common.cuh", "Ctx") == list(abi.CTX_FIELDS)
    assert abi.CTX_WORDS == sum(n for _, n in abi.CTX_FIELDS) == 224
    # the word indices the struct's comments and the kernels' peer arrays rely on
    assert [abi.CTX_INDEX[f] for f in ("rank", "timeout_ns", "ctr", "derr", "herr", "off_esig", "off_flist",
                                       "pad", "base", "gbase", "pbase")] == [0, 7, 8, 9, 10, 11, 22, 23, 32, 96, 160]


def test_ctx_constants_match_common_cuh():
    d = _defines("common.cuh")
    assert d["MAXR"] == abi.MAXR
    assert d["CTR_WORDS"] == abi.CTR_WORDS and d["MAX_CHUNKS"] == abi.MAX_CHUNKS
    assert d["CTR_CHUNK"] + d["MAX_CHUNKS"] <= d["CTR_WORDS"]  # per-chunk counters fit the counter area
    assert (d["DT_F32"], d["DT_BF16"], d["DT_F16"]) == (abi.DT_F32, abi.DT_BF16, abi.DT_F16)
    assert d["ERR_TIMEOUT"] == abi.ERR_TIMEOUT
    assert (d["ERR_BAD_IDX"], d["ERR_DUP_IDX"], d["ERR_NONFINITE"], d["ERR_TOTAL"]) == (
        abi.ERR_BAD_IDX, abi.ERR_DUP_IDX, abi.ERR_NONFINITE, abi.ERR_TOTAL)
    assert d["ERR_NONFINITE_X"] == abi.ERR_NONFINITE_X  # fp8 dispatch: ORed into route_gather's flags


def test_ctx_words_places_every_field():
    offs = {f"off_{n}": 1000 + i for i, n in enumerate(abi.CTX_OFFSETS)}
    w = abi.ctx_words(rank=1, R=3, S=4, K=5, H=6, cap=7, E2=8, timeout_ns=9, ctr=10, derr=11, herr=12, **offs,
                      base=[100, 101, 102], gbase=None, pbase=(300, 301, 302))
    assert len(w) == abi.CTX_WORDS
    assert w[:11] == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert w[11:11 + len(abi.CTX_OFFSETS)] == list(offs.values())
    i = abi.CTX_INDEX
    assert w[i["base"]:i["base"] + 4] == [100, 101, 102, 0] and w[i["gbase"]:i["gbase"] + abi.MAXR] == [0] * abi.MAXR
    assert w[i["pbase"]:i["pbase"] + 3] == [300, 301, 302] and w[i["pad"]:i["base"]] == [0] * 9
    with pytest.raises(TypeError):
        abi.ctx_words(rank=1)
    with pytest.raises(TypeError):
        abi.ctx_words(**{n: 0 for n, c in abi.CTX_FIELDS if c == 1}, bogus=1)


def test_planner_constants_match_sources():
    p, lay = _defines("planner.cu"), _defines("layout.cu")
    assert (p["FLAG_INTS"], p["HIST_BLOCKS"]) == (pcuda.FLAG_INTS, pcuda.HIST_BLOCKS)
    for f in ("F_C32", "F_CAP", "F_COLSUM", "F_ASSIGN", "F_DECL_SCALAR", "F_DECL_PTR", "F_FUSED", "F_AMT_SMEM"):
        assert p[f] == getattr(pcuda, f), f
    assert lay["CFG_B"] == pcuda.LAY_B_SHIFT and lay["CFG_SUB"] == pcuda.LAY_SUB_SHIFT
    assert lay["CFG_NW"] == pcuda.LAY_NW_SHIFT
    for c, py in (("CFG_T32", "LAY_T32"), ("CFG_C32", "LAY_C32"), ("CFG_STAGE", "LAY_STAGE"), ("CFG_PRE", "LAY_PRE")):
        assert 1 << lay[c] == getattr(pcuda, py), c


def _ws_layout():
    """[(field, C size expression)] of ws_layout in planner.cu, in order (the last field has no size)."""
    body = re.search(r"Ws\s+ws_layout\([^)]*\)\s*\{(.*?)return s;", _text("planner.cu"), re.S).group(1)
    out = []
    for m in re.finditer(r"s\.(\w+)\s*=\s*(?:\([^)]*\))?\s*\(?w \+ o\)?;(?:\s*o \+= ([^;]+);)?", body):
        out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("R, E", [(1, 1), (2, 8), (3, 9), (8, 256), (64, 896), (16, 4096)])
@pytest.mark.parametrize("c32", [False, True])
def test_workspace_layout_matches_ws_layout(R, E, c32):
    fields = _ws_layout()
    assert [f for f, _ in fields] == ["A", "rx", "rs", "rc", "L", "rem", "amt", "cst", "crk", "cseg", "err",
                                      "flags", "pre", "hist", "c64"]
    g = pcuda._Geo(R, E, c32)
    consts = dict(R=R, E=E, FLAG_INTS=pcuda.FLAG_INTS, HIST_BLOCKS=pcuda.HIST_BLOCKS)
    o = 0
    for name, size in fields:
        assert getattr(g, name) == o, name
        if size is not None:
            o += eval(size.replace("/", "//"), {}, consts)  # noqa: S307 - positive ints: C division is floor
    assert g.c64 == o and g.words >= o + (R * E if c32 else 0)


def _kernels_defined(files):
    src = "\n".join(_text(f) for f in files)
    names = set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(', src))
    for macro in re.findall(r"#define\s+(\w+)\(NAME\b[^\n]*\\\n\s*extern\s+\"C\"", src):  # macro-made kernels
        names |= set(re.findall(r"^" + macro + r"\((\w+),", src, re.M))
    return names - {"NAME"}


@pytest.mark.parametrize("program", sorted(cuda_runtime.PROGRAMS))
def test_programs_load_every_kernel(program):
    prog = cuda_runtime.PROGRAMS[program]
    assert set(prog.kernels) == _kernels_defined(prog.files)
    src = cuda_runtime.program_source(program)  # one translation unit: no include of its own files left
    assert "#pragma once" not in src and not re.search(r'#include\s+"', src)
