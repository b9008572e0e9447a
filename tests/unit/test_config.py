"""The configuration surface: Tuning validates its fields, moonep.config.ENV lists every MOONEP_*
environment variable that the package, its tests, tools and benchmarks read (and no stale one), and the
package itself reads at most eight of them."""
import re
from pathlib import Path

import pytest

import moonep
from moonep import cuda_runtime
from moonep.config import ENV, Tuning, parse_fused

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(-D)?\b(MOONEP_[A-Z0-9_]*[A-Z0-9])\b")
READ = re.compile(r"""(?:env_float|env_int|env_flag|environ\.get|environ\[|getenv)\(?\s*["'](MOONEP_[A-Z0-9_]+)""")
# compile-time switches of the kernels (cuda_runtime.profile_build, tools/diag_nvlink.patch), not variables
DEFINES = set(cuda_runtime.PROFILE_SWITCHES) | {"MOONEP_DIAG"}
# variables that once overrode a Tuning or the kernel build: the tests set them to show they are not read
RETIRED = {"MOONEP_NVLINK_FUSED", "MOONEP_NVLINK_CHUNKS", "MOONEP_NVLINK_COMBINE_SMS", "MOONEP_LAY_TILES",
           "MOONEP_NVLINK_DIAG", "MOONEP_LINEINFO", "MOONEP_GIT_COMMIT", "MOONEP_MACHINE_KIND"}


def _mentions():
    """MOONEP_* names in code and scripts (compile-time defines, written -DNAME, are not variables)."""
    found = {}
    for folder in ("moonep", "tests", "tools", "benchmarks", "scripts", "examples", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") or path.name == "run":
                text = path.read_text(errors="replace")
                if path == ROOT / "moonep" / "config.py":  # the table itself is not a use
                    text = re.sub(r'_TABLE = """.*?"""', "", text, flags=re.S)
                for m in NAME.finditer(text):
                    if not m.group(1) and m.group(2) not in DEFINES | RETIRED:
                        found.setdefault(m.group(2), str(path.relative_to(ROOT)))
    return found


def test_every_env_var_is_listed():
    unlisted = {n: p for n, p in _mentions().items() if n not in ENV}
    assert not unlisted, f"MOONEP_* variables read but not listed in moonep/config.py ENV: {unlisted}"


def test_the_package_reads_at_most_eight_variables():
    """Profiling switches live in tools/ and benchmarks/; the library reads its runtime settings and the
    two test switches (the fallbacks, the order board's checksums), none of which changes a result."""
    read = {}
    for path in (ROOT / "moonep").rglob("*.py"):
        for name in READ.findall(path.read_text()):
            read.setdefault(name, str(path.relative_to(ROOT)))
    assert len(read) <= 8, read
    assert set(read) == {"MOONEP_TIMEOUT", "MOONEP_NVLINK_TIMEOUT", "MOONEP_CHECK_ORDER", "MOONEP_MASTER_ADDR",
                         "MOONEP_NO_CUPY", "MOONEP_BOARD_CHECK"}, read
    assert {n for n, v in ENV.items() if v.group in ("runtime", "library tests")} == set(read)


def test_no_stale_env_var():
    stale = set(ENV) - set(_mentions())
    assert not stale, f"listed in moonep/config.py ENV but read nowhere: {sorted(stale)}"


def test_tuning_checks_and_no_env_overrides(monkeypatch):
    assert Tuning().fused == ("route", "dispatch")
    assert Tuning(fused=["combine", "route"]).fused == ("route", "combine")  # canonical order
    for bad in (dict(num_sms=0), dict(chunks=9), dict(combine_sms=0), dict(fused=("route", "nope")),
                dict(fused="route")):
        with pytest.raises(ValueError, match=r"^tuning\.\w+: expected"):
            Tuning(**bad)
    assert parse_fused("0") == () and parse_fused("1") == ("route", "dispatch", "combine")
    with pytest.raises(ValueError, match="--fused: expected"):
        parse_fused("route,warp", "--fused")
    # an explicit Tuning is what runs: the variables that used to override it are not read
    monkeypatch.setenv("MOONEP_NVLINK_FUSED", "0")
    monkeypatch.setenv("MOONEP_NVLINK_CHUNKS", "2")
    assert not hasattr(Tuning, "with_env")
    t = Tuning(num_sms=8)
    assert (t.fused, t.chunks, t.num_sms) == (("route", "dispatch"), 4, 8)


def test_tuning_is_public_and_refused_when_wrong():
    with pytest.raises(ValueError, match="^tuning: expected None or a moonep.Tuning, got dict"):
        moonep.ExpertParallel(num_experts=4, topk=2, hidden=8, max_tokens=4, tuning={"num_sms": 3})
