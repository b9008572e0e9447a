"""Multi-rank tests from an ordinary ``pytest`` run.

A cases file holds ``case_<name>(rt)`` functions. One ``mpiexec -n N`` launch runs all of them (paying
``import torch`` once per rank, not once per test); each case still shows up as its own pytest item:

    # tests/mp/test_mp_bootstrap.py
    from tests.harness.mp import mp_cases
    test_bootstrap = mp_cases("tests/mp/cases_bootstrap.py", nranks=[1, 2, 4])

The launch runs in its own session with a timeout: on expiry the whole process group is killed, so no
rank outlives the test. A failing rank aborts the job; its traceback becomes that case's failure message.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .mprun import SkipCase  # noqa: F401  (re-exported for cases files)

REPO_ROOT = Path(__file__).resolve().parents[2]


def mpiexec_cmd(n: int) -> list[str]:
    """The launcher prefix for ``n`` ranks: ``MOONEP_MPIEXEC``, the environment's MPICH, or PATH's mpiexec."""
    exe = os.environ.get("MOONEP_MPIEXEC")
    if not exe:
        local = Path(sys.executable).parent / "mpiexec"
        exe = str(local) if local.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
    if not exe:
        raise RuntimeError("no mpiexec found: `pip install mpich` (the test extra) or set MOONEP_MPIEXEC")
    cmd = [exe, "-n", str(n)]
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in ver or "OpenRTE" in ver:
        cmd[1:1] = ["--oversubscribe", "--allow-run-as-root"]  # Open MPI refuses both by default
    return cmd


def _launch_pids(launch_id: str) -> list[int]:
    """Processes carrying this launch's marker in their environment (hydra gives each rank its own session,
    and ranks are re-parented when a proxy dies, so neither process groups nor parent links find them all)."""
    marker = f"MOONEP_LAUNCH_ID={launch_id}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker in (p / "environ").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def _kill_launch(launch_id: str, wait: float = 15.0) -> None:
    """SIGKILL every process of a launch and wait until they are gone."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        pids = _launch_pids(launch_id)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


@dataclass
class Launch:
    """What one ``mpiexec`` launch left behind."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    records: dict = field(default_factory=dict)  # case -> list of per-rank records
    timed_out: bool = False

    def outcome(self, case: str, n: int):
        if case == TEARDOWN:  # every case passed, yet a rank crashed on the way out: still a failure
            if self.returncode == 0:
                return "passed", ""
            return "failed", (f"launch exit code {self.returncode} ({'timed out' if self.timed_out else 'after the cases'})"
                              f"\n--- stderr tail ---\n{self.stderr[-4000:]}")
        recs = self.records.get(case, [])
        failed = [r for r in recs if r["status"] == "failed"]
        if failed:
            return "failed", "\n".join(r["msg"] for r in failed)
        if len(recs) == n and all(r["status"] == "skipped" for r in recs):
            return "skipped", recs[0]["msg"]
        if len(recs) == n:
            return "passed", ""
        setup = [r for rs in self.records.values() for r in rs if r["status"] == "failed"]
        why = "timed out" if self.timed_out else f"exit code {self.returncode}"
        first = setup[0]["msg"] if setup else ""
        return "failed", (f"case did not complete on all {n} ranks ({len(recs)} reported; launch {why}"
                          f" after {self.seconds:.1f}s)\n{first}\n--- stderr tail ---\n{self.stderr[-4000:]}")


def run_bounded(cmd: list, *, timeout: float, env: dict, cwd=REPO_ROOT, cleanup=None):
    """Run ``cmd`` in a session of its own, for at most ``timeout`` seconds: ``(returncode, stdout, stderr,
    timed_out)``.  Whatever it leaves running is killed afterwards, after a clean exit too (its session, and
    ``cleanup()`` when given: processes a launcher started outside it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if cleanup is not None:
            cleanup()
    if timed_out:
        out, err = proc.communicate()
    return proc.returncode, out, err, timed_out


def launch(cases_file: str, n: int, *, timeout: float = 600, case_timeout: float = 120, tag: str = "",
           env: dict | None = None, keep_going: float = 0.0) -> Launch:
    """Run every case of ``cases_file`` (several files: comma-separated) on ``n`` ranks; never outlives
    ``timeout`` seconds.  ``keep_going``: see ``mprun --keep-going`` (0: the first failure ends the job)."""
    out = tempfile.mkdtemp(prefix="moonep-mp-")
    cmd = mpiexec_cmd(n) + [sys.executable, "-m", "tests.harness.mprun", str(cases_file), "--out", out,
                            "--case-timeout", str(case_timeout), "--tag", tag, "--keep-going", str(keep_going)]
    launch_id = uuid.uuid4().hex
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MOONEP_LAUNCH_ID=launch_id,
                    **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    # whatever is left of the launch (hydra proxies, ranks) is killed even after a clean exit
    rc, stdout, stderr, timed_out = run_bounded(cmd, timeout=timeout, env=full_env,
                                                cleanup=lambda: _kill_launch(launch_id))
    result = Launch(rc, time.monotonic() - t0, stdout, stderr, timed_out=timed_out)
    for f in sorted(Path(out).glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rec = _record(line)
                result.records.setdefault(rec["case"], []).append(rec)
    shutil.rmtree(out, ignore_errors=True)
    return result


def _record(line: str) -> dict:
    """One rank's JSON line; a line cut short (the job was aborted while a rank wrote it) is that case's failure,
    its text as the message."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        head = line.split('"case": "', 1)[-1].split('"', 1)[0]
        return {"case": head, "status": "failed", "rank": -1, "msg": f"(a line cut short) {line}"}


def case_names(cases_file: str) -> list[str]:
    """The ``case_*`` functions of a file, found without importing it (no torch import in pytest)."""
    tree = ast.parse(Path(REPO_ROOT, cases_file).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("case_")]


_CACHE: dict = {}
_GROUPS: dict = {}  # (group, env) -> {cases file: (world sizes, timeout, case timeout)}
TEARDOWN = "teardown"  # a pseudo-case: the launch as a whole exited cleanly


def mp_cases(cases_file: str, nranks, *, timeout: float = 600, case_timeout: float = 120, env=None,
             group: str | None = None):
    """Build a pytest test parametrised over (case, N); one ``mpiexec`` launch per N serves all cases.

    ``group``: the cases files collected with the same group name (and environment) share that launch, so
    ``import torch`` and the runtime's start are paid once per N for all of them; their case names must
    differ.  A failing case then also fails the group's later cases at that N."""
    import pytest

    names = case_names(cases_file) + [TEARDOWN]
    env = dict(env or {})
    env_key = tuple(sorted(env.items()))
    if group is not None:  # registered at collection, so every member is known before any launch
        members = _GROUPS.setdefault((group, env_key), {})
        members[cases_file] = (set(nranks), timeout, case_timeout)

    @pytest.mark.parametrize("n", list(nranks), ids=lambda n: f"np{n}")
    @pytest.mark.parametrize("case", names)
    def test(case, n):
        files, t_out, t_case = [cases_file], timeout, case_timeout
        if group is not None:
            members = _GROUPS[(group, env_key)]
            files = [f for f, (ns, _, _) in members.items() if n in ns]
            t_out = max(members[f][1] for f in files)
            t_case = max(members[f][2] for f in files)
        key = (tuple(files), n, env_key)
        if key not in _CACHE:
            _CACHE[key] = launch(",".join(files), n, timeout=t_out, case_timeout=t_case, env=env)
        status, msg = _CACHE[key].outcome(case, n)
        if case == TEARDOWN:  # the cases' own notes ("[rank r] ..." on stderr), shown by `pytest -rA`
            print("\n".join(ln for ln in _CACHE[key].stderr.splitlines() if ln.startswith("[rank ")))
        if status == "skipped":
            pytest.skip(msg)
        if status == "failed":
            pytest.fail(msg, pytrace=False)

    return test


# GPU test files: world sizes from MOONEP_GPU_NRANKS (default "2 4": one rank per GPU on 2 GPUs, then two
# ranks per GPU) and the environment every CUDA case runs with (NVLink multicast stays off).
GPU_ENV = {"MOONEP_TEST_DEVICE": "cuda", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_nranks() -> list:
    return [int(n) for n in os.environ.get("MOONEP_GPU_NRANKS", "2 4").split()]
