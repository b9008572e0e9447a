"""The configuration surface: Tuning validates its fields, and moonep.config.ENV lists every MOONEP_*
environment variable that the package, its tests, tools and benchmarks read (and no stale one)."""
import re
from pathlib import Path

import pytest

import moonep
from moonep.config import ENV, Tuning, parse_fused

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(-D)?\b(MOONEP_[A-Z0-9_]*[A-Z0-9])\b")


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
                    if not m.group(1):
                        found.setdefault(m.group(2), str(path.relative_to(ROOT)))
    return found


def test_every_env_var_is_listed():
    unlisted = {n: p for n, p in _mentions().items() if n not in ENV}
    assert not unlisted, f"MOONEP_* variables read but not listed in moonep/config.py ENV: {unlisted}"


def test_no_stale_env_var():
    stale = set(ENV) - set(_mentions())
    assert not stale, f"listed in moonep/config.py ENV but read nowhere: {sorted(stale)}"


def test_tuning_checks_and_env_overrides(monkeypatch):
    assert Tuning().fused == ("route", "dispatch")
    assert Tuning(fused=["combine", "route"]).fused == ("route", "combine")  # canonical order
    for bad in (dict(num_sms=0), dict(chunks=9), dict(combine_sms=0), dict(fused=("route", "nope")),
                dict(fused="route")):
        with pytest.raises(ValueError, match=r"^tuning\.\w+: expected"):
            Tuning(**bad)
    assert parse_fused("0") == () and parse_fused("1") == ("route", "dispatch", "combine")
    with pytest.raises(ValueError, match="MOONEP_NVLINK_FUSED: expected"):
        monkeypatch.setenv("MOONEP_NVLINK_FUSED", "route,warp")
        Tuning().with_env()
    monkeypatch.setenv("MOONEP_NVLINK_FUSED", "0")
    monkeypatch.setenv("MOONEP_NVLINK_CHUNKS", "2")
    t = Tuning(num_sms=8).with_env()
    assert (t.fused, t.chunks, t.num_sms) == ((), 2, 8)


def test_tuning_is_public_and_refused_when_wrong():
    with pytest.raises(ValueError, match="^tuning: expected None or a moonep.Tuning, got dict"):
        moonep.ExpertParallel(num_experts=4, topk=2, hidden=8, max_tokens=4, tuning={"num_sms": 3})
