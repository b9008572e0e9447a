"""The multi-rank harness itself: failures surface fast, nothing is left running, launches don't collide."""
import threading
import uuid
from pathlib import Path

from tests.harness.mp import REPO_ROOT, launch


def _stray_processes(tag):
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if tag.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def test_failing_rank_aborts_job_within_60s():
    tag = uuid.uuid4().hex
    res = launch("tests/mp/harness_faults.py", 4, timeout=120, tag=tag)  # 3 ranks left waiting on rank 3
    assert res.seconds < 60, res.seconds
    status, msg = res.outcome("case_one_rank_fails", 4)
    assert status == "failed"
    assert "[rank 3/4]" in msg and "deliberate failure on rank 3" in msg, msg
    status, msg = res.outcome("case_never_reached", 4)
    assert status == "failed" and "did not complete" in msg
    assert _stray_processes(tag) == []


def test_stalled_rank_is_killed_by_case_timeout():
    tag = uuid.uuid4().hex
    res = launch("tests/mp/harness_stall.py", 2, timeout=120, case_timeout=8, tag=tag)
    assert res.seconds < 60, res.seconds
    status, msg = res.outcome("case_rank1_stalls", 2)
    assert status == "failed"
    assert "harness_stall.py" in msg  # faulthandler's stack dump names the stalled line
    assert _stray_processes(tag) == []


def test_keep_going_runs_on_after_a_failure_on_every_rank():
    """--keep-going: a case that fails on every rank is reported and the next one runs; a failure on one
    rank, with its peers left in a collective, still ends the job (within the keep-going wait)."""
    tag = uuid.uuid4().hex
    res = launch("tests/mp/harness_keep_going.py", 3, timeout=120, tag=tag, keep_going=5,
                 env={"MOONEP_TIMEOUT": "60"})
    assert res.seconds < 60, res.seconds
    status, msg = res.outcome("case_fails_on_every_rank", 3)
    assert status == "failed" and "deliberate failure on every rank" in msg, msg
    assert res.outcome("case_after_a_uniform_failure", 3) == ("passed", "")
    status, msg = res.outcome("case_one_rank_fails", 3)
    assert status == "failed" and "deliberate failure on rank 1" in msg, msg
    assert res.outcome("case_never_reached", 3)[0] == "failed"
    assert res.returncode != 0 and _stray_processes(tag) == []


def test_every_rank_runs_on_the_test_build():
    """MOONEP_TEST_BUILD: every rank compiles the profiling build it names; a malformed one fails the setup."""
    build = "MOONEP_PLAN_CLOCKS=1, MOONEP_DISPATCH_THREADS=768"
    res = launch("tests/mp/harness_build.py", 2, timeout=120, env={"MOONEP_TEST_BUILD": build})
    assert res.outcome("case_the_test_build_is_in_force", 2) == ("passed", ""), res.stderr[-3000:]
    res = launch("tests/mp/harness_build.py", 2, timeout=120, env={"MOONEP_TEST_BUILD": "MOONEP_PLAN_CLOCKS"})
    assert res.returncode != 0 and "MOONEP_TEST_BUILD: expected comma-separated NAME=INT" in res.stderr, \
        res.stderr[-3000:]


def test_two_launches_at_once_do_not_interfere():
    results = {}

    def run(i):
        results[i] = launch("tests/mp/cases_bootstrap.py", 2, timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res in results.values():
        for case in res.records:
            assert res.outcome(case, 2)[0] == "passed", res.outcome(case, 2)[1]
        n_cases = (REPO_ROOT / "tests/mp/cases_bootstrap.py").read_text().count("\ndef case_")
        assert len(res.records) == n_cases
