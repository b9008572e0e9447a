"""Where a benchmark figure came from: the exact command, the git commit and the machine.

The GPU machines receive a copy of the working tree without ``.git``: the commit is then read from the file
``.git_commit`` at the repository's root, which the caller writes (``git rev-parse HEAD > .git_commit``).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """``HEAD`` (with ``-dirty`` when tracked files differ) of the repository this package lies at the root of;
    otherwise (no git, or an installed package inside some other repository) what ``.git_commit`` names."""
    try:
        top, _, head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                      text=True, cwd=ROOT).stdout.strip().partition("\n")
        if not top or Path(top).resolve() != ROOT.resolve():
            head = ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip() if head else ""
    except OSError:
        head = dirty = ""
    if head:
        return head + ("-dirty" if dirty else "")
    stamp = ROOT / ".git_commit"
    return (stamp.read_text().strip() or "unknown") if stamp.exists() else "unknown"


def machine() -> dict:
    """Host, CPU, core count, torch, and the GPUs when there are any."""
    import torch

    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def command(argv=None, launcher: str = "") -> str:
    """The command line that produced this run, launcher prefix included."""
    args = sys.argv if argv is None else argv
    return (launcher + " " if launcher else "") + " ".join(shlex.quote(a) for a in args)
