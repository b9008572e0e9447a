"""Copy a device run's outputs into benchmarks/results/, stamping the commit and machine kind.

    python tools/keep_device_results.py /tmp/run COMMIT NAME [--kind nvidia-h200-x2] [--command "..."]

NAME is the prefix of the kept files: the machine, then what was measured (e.g. ``h200x2_suite``).

JSON files keep every field; a ``commit`` of "HEAD"/None/"unknown" is replaced by COMMIT (the tree sent to
the device had no .git). Logs (*.txt) go to benchmarks/results/gpu_runs/NAME_<file>, under a header line naming commit, machine and
command.
"""
import argparse
import json
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("commit")
ap.add_argument("name")
ap.add_argument("--kind", default="nvidia-h200-x2")
ap.add_argument("--command", default="", help="the device command, written as a header into kept logs")
a = ap.parse_args()
dst = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
for f in sorted(Path(a.src).iterdir()):
    if f.suffix == ".json":
        d = json.loads(f.read_text())
        for key in ("commit", "git_commit"):
            if key in d and d[key] != a.commit:  # the tree sent was COMMIT, whatever git said there
                if d[key] not in (None, "HEAD", "unknown", ""):
                    d["commit_reported_on_device"] = d[key]
                d[key] = a.commit
        d.setdefault("device_kind", a.kind)
        out = dst / f"{a.name}_{f.name}"
        out.write_text(json.dumps(d, indent=1))
        print("kept", out)
    elif f.suffix == ".txt":
        out = dst / "gpu_runs" / f"{a.name}_{f.name}"
        head = f"# commit {a.commit}; machine {a.kind}" + (f"; command: {a.command}" if a.command else "") + "\n"
        out.write_text(head + f.read_text(errors="replace"))
        print("kept", out)
