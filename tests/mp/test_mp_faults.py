"""Fault injection on CPU ranks under mpiexec: mismatched collective order, stalls, killed ranks, interrupts
at every wait, ranks in different collectives, and resource hygiene (create/close ExpertParallel 100
times).  See docs/reliability.md."""
from tests.harness.mp import mp_cases

# one launch per world size for the three files (at 3 ranks all of them, at 2 the last two)
test_faults = mp_cases("tests/mp/cases_faults.py", nranks=[3], case_timeout=60, group="faults")
test_interrupts = mp_cases("tests/mp/cases_interrupts.py", nranks=[2, 3], case_timeout=240, group="faults")
test_disagree = mp_cases("tests/mp/cases_disagree.py", nranks=[2, 3], case_timeout=120, group="faults")
test_hygiene = mp_cases("tests/mp/cases_hygiene.py", nranks=[2], case_timeout=120)
test_order_board = mp_cases("tests/mp/cases_order_board.py", nranks=[3], case_timeout=60)


# -- killed ranks: a dead rank ends an ordinary mpiexec job, so these run with auto-cleanup off -------------
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

sys.path.insert(0, str(REPO_ROOT / "tests" / "mp"))
from fault_kill import SCENARIOS, VICTIM_EXIT  # noqa: E402

KILL_TIMEOUT = 3.0
_KILL: dict = {}


def _kill_launch_results():
    """One launch for every scenario (pairs of ranks); returns (per-rank records, seconds, returncode)."""
    if "res" in _KILL:
        return _KILL["res"]
    cmd = mpiexec_cmd(2 * len(SCENARIOS))
    ver = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    if "HYDRA" not in ver:
        _KILL["res"] = None
        return None
    out = tempfile.mkdtemp(prefix="moonep-kill-")
    launch_id = uuid.uuid4().hex
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MOONEP_LAUNCH_ID=launch_id)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    full = [cmd[0], "-disable-auto-cleanup"] + cmd[1:] + [
        sys.executable, str(REPO_ROOT / "tests" / "mp" / "fault_kill.py"), "--out", out,
        "--timeout", str(KILL_TIMEOUT)]
    t0 = time.monotonic()
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=REPO_ROOT)
    try:
        text = proc.communicate(timeout=150)[0]
        ended = True
    except subprocess.TimeoutExpired:
        ended = False
        _kill_launch(launch_id)
        text = proc.communicate()[0]
    _kill_launch(launch_id)
    seconds = time.monotonic() - t0
    recs = {}
    for f in Path(out).glob("rank*.json"):
        rec = json.loads(f.read_text())
        recs[rec["rank"]] = rec
    _KILL["res"] = (recs, seconds, ended, text)
    return _KILL["res"]


@pytest.mark.parametrize("pair", range(len(SCENARIOS)), ids=[f"{o}-{t}" for o, t, _ in SCENARIOS])
def test_killed_rank_survivor_raises(pair):
    res = _kill_launch_results()
    if res is None:
        pytest.skip("needs MPICH's mpiexec (-disable-auto-cleanup)")
    recs, seconds, ended, text = res
    op, transport, victim = SCENARIOS[pair]
    vrank, srank = 2 * pair + victim, 2 * pair + 1 - victim
    ctx = f"{op}/{transport}: records {recs.get(vrank)} / {recs.get(srank)}\n--- output tail ---\n{text[-3000:]}"
    assert ended, f"the job did not end by itself within 150 s\n{ctx}"
    assert recs.get(vrank, {}).get("event") == "dying", ctx
    s = recs.get(srank, {})
    assert s.get("event") == "raised", ctx
    delay = s["t"] - recs[vrank]["t"]
    assert delay <= KILL_TIMEOUT + 5, f"survivor raised {delay:.1f}s after the victim died\n{ctx}"
    name = "QuantileBalancer.step" if op == "qb_step" else op
    assert name in s["msg"], ctx
    assert f"{KILL_TIMEOUT:g}s" in s["msg"] or "MOONEP_TIMEOUT" in s["msg"], ctx
    if transport == "mpi":  # the victim's sub-rank, named by the header or the all-to-all timeout message
        assert f"rank {victim}" in s["msg"] or "all_to_all" in s["msg"], ctx
