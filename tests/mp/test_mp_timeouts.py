"""Every wait has a timeout (tests/mp/cases_timeouts.py at 2 and 4 ranks), plus the waits of
``moonep.init`` and ``Runtime.shutdown`` under mpiexec: a rank late for init, a rank stalled in shutdown."""
from tests.harness.mp import mp_cases

test_timeouts = mp_cases("tests/mp/cases_timeouts.py", nranks=[2, 4], case_timeout=60)


# -- moonep.init and Runtime.shutdown: one small launch each (the job is left broken on purpose) ----------
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.harness.mp import REPO_ROOT, _kill_launch, mpiexec_cmd  # noqa: E402

TIMEOUT = 2.0
SCRIPT = r'''
import json, os, sys, time
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
scenario, out, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
rec = {"rank": rank}
import moonep
import torch.distributed as dist
if scenario == "late_init":
    if rank == 1:
        time.sleep(timeout + 3)
    t0 = time.monotonic()
    try:
        moonep.init(device="cpu", timeout=timeout)
        rec["event"] = "initialised"
    except moonep.MoonepError as exc:
        rec.update(event="raised", msg=str(exc))
    rec["seconds"] = time.monotonic() - t0
elif scenario == "stalled_shutdown":
    rt = moonep.init(device="cpu", timeout=timeout)
    if rank == 1:  # stalls inside shutdown, after the gloo barrier, before the final MPI barrier
        real = dist.destroy_process_group
        def slow(*a, **k):
            time.sleep(timeout + 3)
            return real(*a, **k)
        dist.destroy_process_group = slow
    t0 = time.monotonic()
    rt.shutdown()
    rec.update(event="returned", seconds=time.monotonic() - t0, failed=rt.failed)
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
    json.dump(rec, f)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
deadline = time.monotonic() + 20  # stay (without calling MPI) until the other rank has reported too
while time.monotonic() < deadline and not os.path.exists(os.path.join(out, f"rank{1 - rank}.json")):
    time.sleep(0.05)
sys.stdout.flush()
os._exit(0)  # no MPI_Finalize: the job was left broken on purpose
'''


def _launch(scenario: str):
    cmd = mpiexec_cmd(2)
    ver = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in ver:
        pytest.skip("needs MPICH's mpiexec (-disable-auto-cleanup: ranks leave a broken job on purpose)")
    out = tempfile.mkdtemp(prefix="moonep-to-")
    launch_id = uuid.uuid4().hex
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MOONEP_LAUNCH_ID=launch_id)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    full = [cmd[0], "-disable-auto-cleanup"] + cmd[1:] + [sys.executable, "-c", SCRIPT, scenario, out,
                                                          str(TIMEOUT)]
    t0 = time.monotonic()
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=REPO_ROOT)
    try:
        text = proc.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        _kill_launch(launch_id)
        text = proc.communicate()[0]
    _kill_launch(launch_id)
    recs = {}
    for f in Path(out).glob("rank*.json"):
        rec = json.loads(f.read_text())
        recs[rec["rank"]] = rec
    return recs, time.monotonic() - t0, text


def test_init_with_a_late_rank_raises_within_the_timeout():
    recs, seconds, text = _launch("late_init")
    ctx = f"{recs}\n--- output tail ---\n{text[-3000:]}"
    r0 = recs.get(0, {})
    assert r0.get("event") == "raised", ctx
    assert "moonep.init: rank 0:" in r0["msg"] and f"timeout of {TIMEOUT:g}s" in r0["msg"], ctx
    assert TIMEOUT - 0.5 <= r0["seconds"] <= TIMEOUT + 2, ctx
    # The late rank finds rank 0 gone from the rendezvous: it raises within its own timeout too.
    r1 = recs.get(1, {})
    assert r1.get("event") == "raised" and r1["seconds"] <= TIMEOUT + 2, ctx


def test_shutdown_with_a_stalled_rank_gives_up_within_the_timeout():
    recs, seconds, text = _launch("stalled_shutdown")
    ctx = f"{recs}\n--- output tail ---\n{text[-3000:]}"
    r0 = recs.get(0, {})
    assert r0.get("event") == "returned" and r0["failed"], ctx  # gave the barrier up, quietly
    assert TIMEOUT - 0.5 <= r0["seconds"] <= TIMEOUT + 2, ctx
    assert recs.get(1, {}).get("event") == "returned", ctx  # the stalled rank ends as well
