"""Every MOONEP_* variable the package reads is validated: a bad value raises ValueError naming the variable
and the accepted values, a good one works, an empty one counts as unset.  MOONEP_TIMEOUT is read by
moonep.init()/local_runtime(), never at import."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moonep import config
from moonep.config import env_flag, env_float, env_int

ROOT = Path(__file__).resolve().parents[2]
NOT_NUMBERS = ["abc", "1s", "0x10", "--1"]


def _raises(name, fn, raw):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected "), msg
    assert f"got {raw!r}" in msg, msg
    return msg


# -- the readers ---------------------------------------------------------------------------------------
def test_env_float(monkeypatch):
    name = "MOONEP_TIMEOUT"
    monkeypatch.delenv(name, raising=False)
    assert env_float(name, 60.0) == 60.0
    for raw in ("", "  "):
        monkeypatch.setenv(name, raw)
        assert env_float(name, 60.0) == 60.0
    for raw, want in (("2.5", 2.5), ("1e-3", 1e-3), (" 7 ", 7.0), ("300", 300.0)):
        monkeypatch.setenv(name, raw)
        assert env_float(name, 60.0) == want
    for raw in ["0", "-1", "-0.0", "nan", "NaN", "inf", "-inf", "1e999"] + NOT_NUMBERS:
        monkeypatch.setenv(name, raw)
        msg = _raises(name, lambda: env_float(name, 60.0), raw)
        assert "a finite number > 0" in msg


def test_env_int(monkeypatch):
    name = "MOONEP_FUZZ_N"  # any int variable: the parser alone
    monkeypatch.delenv(name, raising=False)
    assert env_int(name, 4, lo=1, hi=8) == 4
    monkeypatch.setenv(name, "")
    assert env_int(name, 4, lo=1, hi=8) == 4
    for raw in ("1", "8", " 3 "):
        monkeypatch.setenv(name, raw)
        assert env_int(name, 4, lo=1, hi=8) == int(raw)
    for raw in ["0", "-1", "9", "nan", "inf", "2.0", "1e1"] + NOT_NUMBERS:
        monkeypatch.setenv(name, raw)
        msg = _raises(name, lambda: env_int(name, 4, lo=1, hi=8), raw)
        assert "an int in [1, 8]" in msg
    monkeypatch.setenv(name, "-3")
    assert "an int >= 0" in _raises(name, lambda: env_int(name, 0, lo=0), "-3")


def test_env_flag(monkeypatch):
    name = "MOONEP_CHECK_ORDER"
    monkeypatch.delenv(name, raising=False)
    assert env_flag(name, True) is True and env_flag(name, False) is False
    monkeypatch.setenv(name, "")
    assert env_flag(name, True) is True
    for raw in ("0", "false", "FALSE", "No", "off", " 0 "):
        monkeypatch.setenv(name, raw)
        assert env_flag(name, True) is False
    for raw in ("1", "true", "True", "YES", "on"):
        monkeypatch.setenv(name, raw)
        assert env_flag(name, False) is True
    for raw in ("2", "-1", "nan", "inf", "abc", "y", "enabled"):
        monkeypatch.setenv(name, raw)
        msg = _raises(name, lambda: env_flag(name, True), raw)
        assert "0, 1, true, false, yes, no" in msg


# -- each variable where the package reads it --------------------------------------------------------------
BAD_TIMEOUTS = ["0", "-1", "nan", "inf", "abc"]


@pytest.mark.parametrize("raw", BAD_TIMEOUTS)
def test_moonep_timeout_bad(monkeypatch, raw):
    import moonep
    from moonep.runtime import default_timeout_s, local_runtime

    import torch.distributed as dist

    had_group = dist.is_initialized()
    monkeypatch.setenv("MOONEP_TIMEOUT", raw)
    _raises("MOONEP_TIMEOUT", default_timeout_s, raw)
    _raises("MOONEP_TIMEOUT", local_runtime, raw)
    _raises("MOONEP_TIMEOUT", moonep.init, raw)  # before any process group is made
    assert dist.is_initialized() == had_group
    # an explicit timeout does not read the variable
    assert local_runtime(timeout=3).timeout.total_seconds() == 3


def test_moonep_timeout_good_and_the_timeout_argument(monkeypatch):
    from moonep.runtime import local_runtime

    monkeypatch.setenv("MOONEP_TIMEOUT", "2.5")
    assert local_runtime().timeout.total_seconds() == 2.5
    monkeypatch.setenv("MOONEP_TIMEOUT", "")
    assert local_runtime().timeout.total_seconds() == 60
    monkeypatch.delenv("MOONEP_TIMEOUT")
    assert local_runtime().timeout.total_seconds() == 60
    for bad in (0, -1, math.nan, math.inf, "5", True):
        with pytest.raises(ValueError, match=r"^timeout: expected None or a finite number of seconds > 0, got "):
            local_runtime(timeout=bad)


def test_bad_moonep_timeout_imports_then_init_raises():
    """`import moonep` never fails because of MOONEP_TIMEOUT; init() names it (in a fresh process)."""
    code = ("import moonep\n"
            "try:\n"
            "    moonep.init()\n"
            "except ValueError as exc:\n"
            "    print('ERR', exc)\n"
            "else:\n"
            "    print('no error')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MOONEP_TIMEOUT="nan", OMP_NUM_THREADS="1")
    for k in ("PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR MOONEP_TIMEOUT: expected a finite number > 0, got 'nan'" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("raw", BAD_TIMEOUTS)
def test_moonep_nvlink_timeout(monkeypatch, raw):
    from moonep.backends.nvlink import default_timeout
    from moonep.runtime import local_runtime

    rt = local_runtime(timeout=9)
    monkeypatch.delenv("MOONEP_NVLINK_TIMEOUT", raising=False)
    assert default_timeout(rt) == 9
    monkeypatch.setenv("MOONEP_NVLINK_TIMEOUT", "4.5")
    assert default_timeout(rt) == 4.5
    monkeypatch.setenv("MOONEP_NVLINK_TIMEOUT", raw)
    _raises("MOONEP_NVLINK_TIMEOUT", lambda: default_timeout(rt), raw)


def test_moonep_check_order(monkeypatch):
    from moonep.guard import check_order_enabled

    monkeypatch.delenv("MOONEP_CHECK_ORDER", raising=False)
    assert check_order_enabled()
    for raw, want in (("0", False), ("false", False), ("1", True), ("yes", True), ("", True)):
        monkeypatch.setenv("MOONEP_CHECK_ORDER", raw)
        assert check_order_enabled() is want
    for raw in ("-1", "nan", "inf", "abc", "2"):
        monkeypatch.setenv("MOONEP_CHECK_ORDER", raw)
        _raises("MOONEP_CHECK_ORDER", check_order_enabled, raw)


def test_moonep_check_order_reaches_expert_parallel(monkeypatch):
    import moonep

    monkeypatch.setenv("MOONEP_CHECK_ORDER", "maybe")
    with pytest.raises(ValueError, match="^MOONEP_CHECK_ORDER: expected"):
        moonep.ExpertParallel(num_experts=4, topk=2, hidden=8, max_tokens=4)


def test_moonep_no_cupy(monkeypatch):
    from moonep import cuda_runtime

    for raw, want_off in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setattr(cuda_runtime, "_AVAILABLE", None)
        monkeypatch.setenv("MOONEP_NO_CUPY", raw)
        got = cuda_runtime.available()
        if want_off:
            assert got is False
    for raw in ("-1", "nan", "inf", "abc", "2"):
        monkeypatch.setattr(cuda_runtime, "_AVAILABLE", None)
        monkeypatch.setenv("MOONEP_NO_CUPY", raw)
        _raises("MOONEP_NO_CUPY", cuda_runtime.available, raw)


def _board_verify(*raws):
    """order_board.VERIFY for each value of MOONEP_BOARD_CHECK (read when the module is imported: imported
    afresh for each, in one process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import importlib, os, sys\n"
            "for raw in sys.argv[1:]:\n"
            "    os.environ['MOONEP_BOARD_CHECK'] = raw\n"
            "    sys.modules.pop('moonep.transport.order_board', None)\n"
            "    try:\n"
            "        print('VERIFY', importlib.import_module('moonep.transport.order_board').VERIFY)\n"
            "    except ValueError as exc:\n"
            "        print('ERR', exc)\n")
    r = subprocess.run([sys.executable, "-c", code, *raws], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-len(raws):]


def test_moonep_board_check():
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    raws = ("1", "yes", "0", "", "abc", "2")
    want = ["VERIFY True", "VERIFY True", f"VERIFY {not x86}", f"VERIFY {not x86}"] + [
        f"ERR MOONEP_BOARD_CHECK: expected one of 0, 1, true, false, yes, no, on, off, got {raw!r}"
        for raw in ("abc", "2")]
    assert _board_verify(*raws) == want


@pytest.fixture
def fresh_build(monkeypatch):
    """cuda_runtime as in a process that has loaded no kernel and sized no planner workspace, restored after
    (on a GPU machine earlier tests have loaded programs, and a build is fixed once they have)."""
    import copy

    from moonep import cuda_runtime
    from moonep.planner import cuda as planner_cuda

    monkeypatch.setattr(cuda_runtime, "_LOADED", {n: {} for n in cuda_runtime.PROGRAMS})
    monkeypatch.setattr(cuda_runtime, "_PROFILE", copy.deepcopy(cuda_runtime._SHIPPED))
    monkeypatch.setattr(cuda_runtime, "_CSRC", None)
    monkeypatch.setattr(planner_cuda, "_GEO", {})
    return cuda_runtime


def test_the_kernel_build_takes_no_environment(monkeypatch, fresh_build):
    """The shipped kernels' build reads nothing from the environment: a profiling build is asked for in code
    (cuda_runtime.profile_build), and its switches are checked."""
    from moonep.planner import cuda as planner_cuda

    cuda_runtime = fresh_build
    for name in ("MOONEP_LINEINFO", "MOONEP_FP8_WORDS", "MOONEP_DISPATCH_THREADS", "MOONEP_PLAN_CLOCKS",
                 "MOONEP_NVLINK_DIAG", "MOONEP_LAY_TILES", "MOONEP_QUANT_SOFT_CVT"):
        monkeypatch.setenv(name, "1")
    assert cuda_runtime.compile_options("ep") == ("-std=c++17", "-DMOONEP_DISPATCH_THREADS=512")
    assert cuda_runtime.compile_options("plan") == ("-std=c++17",)
    assert cuda_runtime.dispatch_threads() == 512 and planner_cuda.lay_tiles() == planner_cuda.LAY_TILES == 48
    cuda_runtime.profile_build(lineinfo=True, MOONEP_PLAN_CLOCKS=1, MOONEP_FP8_WORDS=0, MOONEP_DISPATCH_THREADS=768,
                               MOONEP_QUANT_SOFT_CVT=1)
    assert cuda_runtime.compile_options("plan") == ("-std=c++17", "-lineinfo", "-DMOONEP_PLAN_CLOCKS=1")
    assert cuda_runtime.compile_options("ep") == ("-std=c++17", "-lineinfo", "-DMOONEP_FP8_WORDS=0",
                                                  "-DMOONEP_DISPATCH_THREADS=768", "-DMOONEP_QUANT_SOFT_CVT=1")
    assert cuda_runtime.dispatch_threads() == 768
    for bad, what in ((dict(MOONEP_FP8_WORDS=9), "^MOONEP_FP8_WORDS: expected one of"),
                      (dict(MOONEP_FP8_WORDS=True), "^MOONEP_FP8_WORDS: expected an int, got True"),
                      (dict(MOONEP_DISPATCH_THREADS=544.0), "^MOONEP_DISPATCH_THREADS: expected an int"),
                      (dict(MOONEP_DISPATCH_THREADS=600), "^MOONEP_DISPATCH_THREADS: expected one of"),
                      (dict(MOONEP_DIAG=1), "^switches: expected names from"),
                      (dict(sources="/nonexistent"), "^sources: expected a directory")):
        with pytest.raises(ValueError, match=what):
            cuda_runtime.profile_build(**bad)
    cuda_runtime.profile_build()
    assert cuda_runtime.compile_options("ep") == ("-std=c++17", "-DMOONEP_DISPATCH_THREADS=512")
    cuda_runtime._LOADED["plan"][0] = object()  # a program loaded: the build is fixed, the same one is a no-op
    cuda_runtime.profile_build()
    with pytest.raises(RuntimeError, match="already loaded"):
        cuda_runtime.profile_build(lineinfo=True)


def test_every_program_declares_the_switches_its_sources_read(fresh_build):
    cuda_runtime = fresh_build
    for name, prog in cuda_runtime.PROGRAMS.items():
        src = cuda_runtime.program_source(name)
        read = {s for s in cuda_runtime.PROFILE_SWITCHES if s in src}
        assert read == set(prog.switches), (name, sorted(read), prog.switches)


def test_a_patched_build_compiles_other_sources(tmp_path, fresh_build):
    """tools/diag_nvlink.patch applies to csrc/ exactly (no fuzz), and a build from the patched copy passes the
    patch's own define to every program; the shipped sources hold none of its variants."""
    import shutil
    import subprocess

    if shutil.which("patch") is None:
        pytest.skip("needs the patch program")
    cuda_runtime = fresh_build
    root = Path(__file__).resolve().parents[2]
    assert not any("MOONEP_DIAG" in f.read_text() for f in (root / "csrc").iterdir())
    shutil.copytree(root / "csrc", tmp_path / "csrc")
    subprocess.run(["patch", "-s", "-p1", "--fuzz=0", "-d", str(tmp_path), "-i",
                    str(root / "tools" / "diag_nvlink.patch")], check=True)
    with pytest.raises(ValueError, match="^switches: expected names from"):
        cuda_runtime.profile_build(sources=str(tmp_path / "csrc"), NO_SOURCE_READS_THIS=3)
    cuda_runtime.profile_build(sources=str(tmp_path / "csrc"), MOONEP_DIAG=3)
    assert "-DMOONEP_DIAG=3" in cuda_runtime.compile_options("ep")
    assert "DIAG_FUSED_NO_EXPAND" in cuda_runtime.program_source("ep")
    cuda_runtime.profile_build()
    assert "DIAG_FUSED_NO_EXPAND" not in cuda_runtime.program_source("ep")


def test_every_validated_variable_is_listed():
    for name in ("MOONEP_TIMEOUT", "MOONEP_NVLINK_TIMEOUT", "MOONEP_CHECK_ORDER", "MOONEP_NO_CUPY",
                 "MOONEP_BOARD_CHECK"):
        assert name in config.ENV, name


def test_import_never_reads_the_timeout():
    """The former import-time constant is still there for callers, read when asked for."""
    import moonep.runtime as runtime

    old = os.environ.get("MOONEP_TIMEOUT")
    try:
        os.environ["MOONEP_TIMEOUT"] = "12"
        assert runtime.DEFAULT_TIMEOUT_S == 12
    finally:
        if old is None:
            os.environ.pop("MOONEP_TIMEOUT", None)
        else:
            os.environ["MOONEP_TIMEOUT"] = old
