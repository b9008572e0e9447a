"""Check that benchmarks/results/ holds exactly the files README.md and docs/*.md cite.

    python tools/check_result_citations.py      # exit 1 if a cited file is missing or a kept file is uncited

A citation is a file name of the results folder (with or without a ``benchmarks/results/`` or ``gpu_runs/``
prefix) appearing in the text. Brace lists (``h200x1_planner_ab_A_{prof,clocks}.json``), ``*`` patterns
and a suffix continuing the previous name (``…_ch1.json``, ``_ch8.json``) are expanded.  A citation written
as git's ``COMMIT:benchmarks/results/NAME`` is history (``git show`` prints it): it must exist at that
commit, checked when the repository has its ``.git``, and it keeps no file in the folder.
"""
from __future__ import annotations

import fnmatch
import itertools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NAME = re.compile(r"[A-Za-z0-9_.{},*/-]+\.(?:json|png|txt)")
GIT_REF = re.compile(r"\b([0-9a-f]{7,40}):$")  # what precedes a citation of a file at a commit


def in_history(ref: str, path: str) -> bool:
    """Whether ``path`` exists at commit ``ref`` (True without a ``.git`` to ask)."""
    if not (ROOT / ".git").exists():
        return True
    return subprocess.run(["git", "cat-file", "-e", f"{ref}:{path}"], cwd=ROOT, capture_output=True).returncode == 0


def expand(name: str) -> list[str]:
    parts = re.split(r"\{([^}]*)\}", name)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return ["".join(itertools.chain.from_iterable(zip(fixed, c + ("",)))) for c in itertools.product(*choices)]


def main() -> int:
    kept = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited, missing = set(), []
    for path in texts:
        prev = None
        text = path.read_text(encoding="utf-8")
        for m in NAME.finditer(text):
            raw = m.group(0)
            name = raw.split("benchmarks/results/")[-1]
            if name.startswith("_") and prev:           # `_ch8.json` after `..._ch1.json`
                name = prev.rsplit("_", 1)[0] + name
            ref = GIT_REF.search(text[max(0, m.start() - 41):m.start()])
            if ref:  # a file at a commit: history, not the folder
                missing += [f"{path.relative_to(ROOT)}: {ref[1]}:{raw} (not at that commit)" for n in expand(raw)
                            if "*" not in n and not in_history(ref[1], n)]
                prev = name
                continue
            for n in expand(name):
                hits = [k for k in kept if fnmatch.fnmatch(k, n) or fnmatch.fnmatch(k, "gpu_runs/" + n)]
                if hits:
                    cited.update(hits)
                elif "/" not in n.replace("gpu_runs/", "") and not n.startswith(("moonep", "csrc", "tests")):
                    missing.append(f"{path.relative_to(ROOT)}: {n}")
            prev = name
    uncited = [k for k in kept if k not in cited]
    for m in missing:
        print("cited but not in benchmarks/results/:", m)
    for u in uncited:
        print("kept but not cited:", u)
    print(f"{len(kept)} files kept, {len(cited)} cited")
    return 1 if uncited or missing else 0


if __name__ == "__main__":
    sys.exit(main())
