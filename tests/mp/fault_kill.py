"""Killed ranks on CPU: one process exits in the middle of a dispatch, combine, prefetch or QB step.

A rank's death ends an ordinary mpiexec job at once, so tests/mp/test_mp_faults.py launches this script with
MPICH's ``-disable-auto-cleanup`` and checks what every process reports.  The job is split into pairs
(own MPI communicator and gloo group each); pair ``i`` runs ``SCENARIOS[i]``: after one good step the
victim exits (``os._exit``) inside the named op and the survivor must raise MoonepError within the
timeout, then end by itself (its exit is not helped along by the test).

    mpiexec -disable-auto-cleanup -n 12 python tests/mp/fault_kill.py --out DIR --timeout 3
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (op, transport, victim's rank in its pair).  Rank 0 of the job hosts the TCPStore: never a victim.
SCENARIOS = [("dispatch", "mpi", 1), ("combine", "torch", 1), ("prefetch", "mpi", 0), ("qb_step", "gloo", 1),
             ("dispatch", "torch", 1), ("combine", "mpi", 1)]
VICTIM_EXIT = 17


def _die(out, world_rank, scenario):
    with open(os.path.join(out, f"rank{world_rank}.json"), "w") as f:
        json.dump({"rank": world_rank, "scenario": scenario, "event": "dying", "t": time.time()}, f)
    os._exit(VICTIM_EXIT)


def _ep_scenario(sub, op, transport, victim, timeout, die):
    from faults_common import make_ep, problem

    ep = make_ep(sub, transport, timeout)
    x, idx, w, home = problem(sub, ep.num_experts)
    h = ep.dispatch(x, idx, w)  # one good step
    ep.prefetch(h, home)
    ep.combine(h.tokens, h)
    if sub.rank == victim:  # exit inside the op, after its order header, at its first data exchange
        if op != "dispatch":  # the same calls as the survivor's loop below, up to the op
            h = ep.dispatch(x, idx, w)
        if op == "combine":
            ep.prefetch(h, home)
        ep.transport.all_to_all = ep.transport.all_to_all_sized = lambda *a, **k: die()
        {"dispatch": lambda: ep.dispatch(x, idx, w), "combine": lambda: ep.combine(h.tokens, h),
         "prefetch": lambda: ep.prefetch(h, home)}[op]()
        raise AssertionError("the victim survived its own op")
    for _ in range(50):  # the survivor keeps stepping: it must raise, at this op or the next
        hh = ep.dispatch(x, idx, w)
        ep.prefetch(hh, home)
        ep.combine(hh.tokens, hh)


def _qb_scenario(sub, victim, die):
    import torch
    import torch.distributed as dist

    import moonep

    qb = moonep.QuantileBalancer(num_experts=8, topk=2, group=sub.group)
    g = torch.Generator().manual_seed(sub.rank)
    qb.route(torch.rand(32, 8, generator=g))
    qb.step()  # one good step
    qb.route(torch.rand(32, 8, generator=g))
    if sub.rank == victim:
        dist.all_reduce = lambda *a, **k: die()
    qb.step()
    raise AssertionError("QuantileBalancer.step completed with a dead peer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=3.0)
    args = ap.parse_args()

    import moonep
    from faults_common import isolated

    from tests.harness.mprun import quiet_barrier

    rt = moonep.init(device="cpu")
    pairs = rt.world_size // 2
    assert rt.world_size == 2 * len(SCENARIOS), f"run with {2 * len(SCENARIOS)} ranks"
    pair = rt.rank // 2
    comm = rt.comm.Split(color=pair, key=rt.rank)
    sub = None
    for i in range(pairs):  # every rank creates every pair's group, in the same order
        s = isolated(rt, args.timeout, ranks=[2 * i, 2 * i + 1], comm=comm if i == pair else comm)
        if i == pair:
            sub = s
    op, transport, victim = SCENARIOS[pair]
    name = f"{op}/{transport}"
    quiet_barrier(rt.comm)  # every pair set up before anyone dies
    t0 = time.time()
    rec = {"rank": rt.rank, "scenario": name, "event": "no-error"}
    try:
        die = lambda: _die(args.out, rt.rank, name)  # noqa: E731
        if op == "qb_step":
            _qb_scenario(sub, victim, die)
        else:
            _ep_scenario(sub, op, transport, victim, args.timeout, die)
    except moonep.MoonepError as exc:
        rec.update(event="raised", msg=str(exc))
    except BaseException as exc:  # noqa: BLE001 (reported: the test names it)
        rec.update(event="wrong-error", msg=f"{type(exc).__name__}: {exc}")
    rec.update(t=time.time(), elapsed=time.time() - t0)
    with open(os.path.join(args.out, f"rank{rt.rank}.json"), "w") as f:
        json.dump(rec, f)
    # Wait (through the files, MPI being broken) until every pair's survivor has its record: a process that
    # ends abnormally (gloo's threads can abort at exit with a dead peer) makes mpiexec kill the rest of the
    # job, which must not cut short a survivor still inside its timeout.
    expected = {2 * i + 1 - SCENARIOS[i][2] for i in range(pairs)}
    deadline = time.time() + 10 * args.timeout + 30
    while time.time() < deadline and not all(os.path.exists(os.path.join(args.out, f"rank{r}.json"))
                                              for r in expected):
        time.sleep(0.05)
    # Leave normally: moonep must make the process end even though MPI_Finalize waits for the dead peer.


if __name__ == "__main__":
    main()
