"""Where a benchmark figure came from: the exact command, the git commit and the machine.

The GPU machines receive a copy of the working tree without ``.git``, so the commit can be handed in
through ``MOONEP_GIT_COMMIT`` (``tools/device_run.sh`` does this from ``.git_commit``).
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
    """``HEAD`` (with ``-dirty`` when tracked files differ), or ``MOONEP_GIT_COMMIT`` when set."""
    if os.environ.get("MOONEP_GIT_COMMIT"):
        return os.environ["MOONEP_GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip()
        return (head + ("-dirty" if dirty else "")) if head else "unknown"
    except OSError:
        return "unknown"


def machine() -> dict:
    """Host, CPU, core count, torch, and the GPUs when there are any."""
    import torch

    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if os.environ.get("MOONEP_MACHINE_KIND"):
        info["kind"] = os.environ["MOONEP_MACHINE_KIND"]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def command(argv=None, launcher: str = "") -> str:
    """The command line that produced this run, launcher prefix included."""
    args = sys.argv if argv is None else argv
    return (launcher + " " if launcher else "") + " ".join(shlex.quote(a) for a in args)
