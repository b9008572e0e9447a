"""Every wait has a timeout: a rank that never arrives at construction, a retry after a stalled peer made a
call time out, QuantileBalancer settings that disagree across ranks.

Run by tests/mp/test_mp_timeouts.py at 2, 3 and 4 ranks.  Each case asserts the error on every rank that
waits, the time to raise, and that the next valid step gives the right values (against a dense float64
computation in one process).

Timeouts: the fault phases run on an isolated runtime (its own MPI communicator and gloo group, made by
``faults_common.isolated``) whose timeout is ``T``: ``ExpertParallel(..., timeout=T)`` for the MPI
transport, and the isolated gloo group's own timeout (``T`` too) for the torch transport, whose data
waits are its process group's (the harness's runtime has the default 60 s, so the torch cases never use
it for a fault).  After a gloo timeout the group's connections are closed for good, so the torch cases
check the next valid step on a fresh isolated runtime; the MPI cases check it on the same one.
"""
import time

import torch
import torch.distributed as dist

import moonep
from ep_reference import dense_reference, make_problem, moe_step, my_slice
from faults_common import expect_moonep_error, isolated
from tests.harness.mprun import quiet_barrier

T = 3.0  # timeout of the isolated runtimes and instances (seconds)
SLACK = 2.0  # allowed on top of T to raise (2 cores shared by up to 4 ranks)


def _timed(what, sub, dt):
    """The measured time to raise, on stdout (collected by tests/mp/test_mp_timeouts.py's launch)."""
    print(f"timing: {what} rank {sub.rank}/{sub.world_size}: {dt:.3f}s", flush=True)


def _expect(what, sub, fn, *needles):
    """``fn`` raises MoonepError holding every needle within ``T + SLACK``; returns (message, seconds)."""
    msg, dt = expect_moonep_error(fn, *needles, within=T + SLACK)
    _timed(what, sub, dt)
    return msg, dt


def _ep(sub, transport, **kw):
    E = 2 * sub.world_size
    return moonep.ExpertParallel(sub, num_experts=E, topk=2, hidden=8, max_tokens=16, dtype=torch.float64,
                                 transport=transport, timeout=T, **kw)


def _check_step(sub, ep, seed):
    """One MoE forward (dispatch, prefetch, experts, combine) equal to the dense float64 reference."""
    R, E = sub.world_size, ep.num_experts
    sizes = [16 - 5 * (r % 2) for r in range(R)]
    x, idx, w, w1, w2, _ = make_problem(seed, R, E, 2, 8, 5, sizes, "hot", dtype=torch.float64)
    sl, home = my_slice(sub, sizes), slice(sub.rank * E // R, (sub.rank + 1) * E // R)
    y, _ = moe_step(ep, x[sl], idx[sl], w[sl], w1[home], w2[home])
    torch.testing.assert_close(y, dense_reference(x, idx, w, w1, w2)[sl], atol=1e-12, rtol=0,
                               msg=lambda m: f"rank {sub.rank} seed {seed} {ep.transport_name}: {m}")


def _dispatch_args(sub, ep):
    R, E = sub.world_size, ep.num_experts
    x, idx, w, *_ = make_problem(7, R, E, 2, 8, 5, [16] * R, "uniform", dtype=torch.float64)
    sl = my_slice(sub, [16] * R)
    return x[sl], idx[sl], w[sl]


def _sync(rt):
    # The harness's communicator: every rank arrives (the fault phase is over).  Polled with sleeps: ranks
    # spinning in a blocking barrier starve a late rank still working on a shared core.
    quiet_barrier(rt.comm)


# -- (a) a rank that never arrives at ExpertParallel(...) ------------------------------------------------
def case_construction_missing_rank_mpi(rt):
    """The last rank sleeps past the timeout instead of building the instance: the others raise MoonepError
    naming it after T; it then joins their next attempt, a fresh instance on the same runtime, which works."""
    sub = isolated(rt, timeout=T)
    late = sub.world_size - 1
    if sub.rank == late:
        time.sleep(T + 0.5)
    else:
        _, dt = _expect("mpi construction, waiting rank", sub, lambda: _ep(sub, "mpi"), "ExpertParallel construction",
                        "all_gather_object", f"rank {late} did not join", f"{T:g}s")
        assert dt >= T - 0.5, f"raised after {dt:.2f}s, before the {T:g}s timeout"
    ep = _ep(sub, "mpi")  # the late rank's first attempt, the others' second
    _check_step(sub, ep, seed=1)
    _check_step(sub, ep, seed=2)
    ep.close()


def case_construction_missing_rank_torch(rt):
    """The same over the torch transport: the others raise after the gloo group's timeout T; the group's
    connections are then closed, so the late rank's construction raises at once; a fresh group works."""
    sub = isolated(rt, timeout=T)
    late = sub.world_size - 1
    if sub.rank == late:
        time.sleep(T + 0.5)
        _expect("torch construction, late rank", sub, lambda: _ep(sub, "torch"), "ExpertParallel construction",
                "all_gather_object")
    else:
        _, dt = _expect("torch construction, waiting rank", sub, lambda: _ep(sub, "torch"),
                        "ExpertParallel construction", "all_gather_object", f"timeout {T:g}s")
        assert dt >= T - 0.5, f"raised after {dt:.2f}s, before the {T:g}s timeout"
    _sync(rt)
    sub2 = isolated(rt, timeout=T)
    ep = _ep(sub2, "torch")
    _check_step(sub2, ep, seed=3)
    ep.close()


def case_construction_with_different_transport(rt):
    """The last rank builds with transport="torch", the others with "mpi": nobody blocks, every rank raises
    within T (the MPI ranks naming the missing rank); the next instance, all on MPI, works."""
    sub = isolated(rt, timeout=T)
    odd = sub.world_size - 1
    if sub.rank == odd:
        _expect("different transport, the torch rank", sub, lambda: _ep(sub, "torch"), "ExpertParallel construction")
    else:
        _expect("different transport, an mpi rank", sub, lambda: _ep(sub, "mpi"), "ExpertParallel construction",
                f"rank {odd} did not join")
    _sync(rt)
    ep = _ep(sub, "mpi")  # MPI is untouched by the torch rank's failed gloo gather
    _check_step(sub, ep, seed=4)
    ep.close()


# -- (b) a retry after a stalled peer made a dispatch time out ----------------------------------------------
def _retry_case(rt, transport):
    sub = isolated(rt, timeout=T)
    late = sub.world_size - 1
    ep = _ep(sub, transport)
    _check_step(sub, ep, seed=5)  # dispatch #1, prefetch #2, #3, combine #4
    x, idx, w = _dispatch_args(sub, ep)
    if sub.rank == late:
        time.sleep(T + 1.5)  # the others' dispatch #5 times out meanwhile
        # Arriving late at dispatch #5 and retrying: raises within the timeout, never blocks.
        for i in range(2):
            _expect(f"{transport} stalled rank's late dispatch, call {i + 1}", sub, lambda: ep.dispatch(x, idx, w),
                    "dispatch #")
    else:
        needles = ["dispatch #5"] + ([f"rank {late} did not join", f"{T:g}s"] if transport == "mpi" else
                                     [f"timeout {T:g}s"])
        _, dt = _expect(f"{transport} dispatch with a stalled peer", sub, lambda: ep.dispatch(x, idx, w), *needles)
        assert dt >= T - 0.5, f"raised after {dt:.2f}s, before the {T:g}s timeout"
        for i in range(2):  # retries on the same instance
            msg, dt = _expect(f"{transport} retry {i + 1}", sub, lambda: ep.dispatch(x, idx, w), "dispatch #")
            if transport == "mpi":
                assert "refused" in msg and dt < 1.0, (dt, msg)  # the instance refuses at once
    ep.close()
    _sync(rt)
    fresh = sub if transport == "mpi" else isolated(rt, timeout=T)  # gloo: the old group is closed
    ep2 = _ep(fresh, transport)
    _check_step(fresh, ep2, seed=6)
    _check_step(fresh, ep2, seed=7)
    ep2.close()


def case_retry_after_stalled_dispatch_mpi(rt):
    """MPI: the others raise after T naming the stalled rank; their retries are refused at once (the
    instance is broken); the stalled rank's own late dispatch and retry raise within T; a new instance on
    the same runtime works."""
    _retry_case(rt, "mpi")


def case_retry_after_stalled_dispatch_torch(rt):
    """torch (gloo group with timeout T): the others raise after T; every later call on that group raises
    at once, on every rank; a new instance on a fresh group works."""
    _retry_case(rt, "torch")


GC_BOUND = 15.0  # seconds: ~0.5 s here; a rank starved by spinning peers (4 ranks, 2 cores) took 7 s


def _collect_without_mpi(sub, what):
    """``gc.collect()`` runs no mpi4py call and returns within ``GC_BOUND`` seconds.

    A finalizer that frees a communicator (``Comm.Free`` is collective) or waits on a request would block
    here when a peer skipped the failed call, and only when a collection happens to run.  Such a call is
    refused (the profile hook raises before it runs, so the finalizer fails instead of blocking) and
    reported."""
    import gc
    import sys

    seen = []

    def hook(frame, event, arg):
        if event == "c_call" and type(getattr(arg, "__self__", None)).__module__.startswith("mpi4py"):
            seen.append(f"{type(arg.__self__).__name__}.{arg.__name__} from {frame.f_code.co_filename}:"
                        f"{frame.f_lineno} ({frame.f_code.co_name})")
            raise RuntimeError("an MPI call during garbage collection")

    s0 = _sched()
    t0 = time.monotonic()
    sys.setprofile(hook)
    try:
        gc.collect()
    finally:
        sys.setprofile(None)
    dt = time.monotonic() - t0
    s1 = _sched()
    _timed(what, sub, dt)
    assert not seen, f"rank {sub.rank}: garbage collection called MPI: {seen}"
    # On a core vs waiting for one: tells a blocked collection from a starved one.
    sched = f" (on a core {(s1[0] - s0[0]) / 1e9:.2f}s, waiting for one {(s1[1] - s0[1]) / 1e9:.2f}s)" if s0 else ""
    assert dt <= GC_BOUND, f"rank {sub.rank}: gc.collect() took {dt:.1f}s{sched}"


def _sched():
    """This thread's (ns on a core, ns runnable but waiting) from Linux schedstat, or None."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return [int(v) for v in f.read().split()[:2]]
    except (OSError, ValueError):
        return None


def case_fresh_instance_after_a_peer_skipped_the_failed_call_mpi(rt):
    """The stalled rank never makes the dispatch its peers timed out in: it drops that instance instead.
    Their header of the failed call waits in its queue; the fresh instance on the same runtime drops it as
    a leftover of a dead instance and works (and the others' cancelled receives do not take its headers).

    The dropped instances are left in reference cycles, so garbage collection (not reference counting)
    frees them, their transports and what held their given-up requests: it must not touch MPI (a peer
    skipped the call) and must return promptly, on every rank."""
    sub = isolated(rt, timeout=T)
    late = sub.world_size - 1
    ep = _ep(sub, "mpi")
    _check_step(sub, ep, seed=8)
    x, idx, w = _dispatch_args(sub, ep)
    if sub.rank == late:
        time.sleep(T + 1.0)
    else:
        def failing_dispatch(ep=ep):
            try:
                ep.dispatch(x, idx, w)
            except moonep.MoonepError as exc:
                ep._kept_error = exc  # a cycle through the traceback's frames (which held the requests)
                raise
        _expect("mpi dispatch with a peer that skips it", sub, failing_dispatch, "dispatch #5",
                f"rank {late} did not join")
        del failing_dispatch
    ep._self = ep
    del ep
    _collect_without_mpi(sub, "gc.collect after the skipped call")
    _sync(rt)
    ep2 = _ep(sub, "mpi")
    _check_step(sub, ep2, seed=9)
    _check_step(sub, ep2, seed=10)
    ep2.close()


# -- (c) QuantileBalancer settings that disagree across ranks ------------------------------------------
def _qb_scores(rank, seed, s=24, E=8):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.rand(s, E, generator=g)


def _expect_value_error(fn, want, within=5.0):
    t0 = time.monotonic()
    try:
        fn()
    except ValueError as exc:
        dt = time.monotonic() - t0
        assert str(exc) == want, f"got {str(exc)!r}, want {want!r}"
        assert dt <= within, f"raised after {dt:.2f}s"
        print(f"timing: QuantileBalancer.step {want.split(':')[0]} rank {dist.get_rank()}: {dt:.3f}s", flush=True)
        return dt
    raise AssertionError(f"no ValueError (want {want!r})")


def case_quantile_balancer_settings_disagree(rt):
    """Different ``bins`` (then ``ema``) on one rank: ``step()`` raises ValueError on every rank naming the
    argument and each rank's value, before the counts' all-reduce (which would abort inside gloo); the
    balancer keeps refusing; a correctly built one steps, equal to one process that sees every rank's
    scores."""
    R, r, E, K = rt.world_size, rt.rank, 8, 2
    bins = [1000] * R
    bins[-1] = 500
    qb = moonep.QuantileBalancer(E, K, bins=bins[r])
    qb.route(_qb_scores(r, 1))
    want = "bins: expected the same value on every rank, got " + "; ".join(
        f"rank {i}: {b}" for i, b in enumerate(bins))
    _expect_value_error(qb.step, want)
    _expect_value_error(qb.step, want)  # still refused, still on every rank
    assert int(qb.num_steps) == 0 and not qb.bias.any()

    ema = [0.0] * R
    ema[0] = 0.5
    qb = moonep.QuantileBalancer(E, K, ema=ema[r])
    qb.route(_qb_scores(r, 2))
    _expect_value_error(qb.step, "ema: expected the same value on every rank, got " + "; ".join(
        f"rank {i}: {e!r}" for i, e in enumerate(ema)))

    # The next valid balancer: pooled over the ranks = one process routing every rank's scores.
    solo = [dist.new_group([i], backend="gloo") for i in range(R)][r]  # every rank makes every group
    good = moonep.QuantileBalancer(E, K, bins=1000)
    ref = moonep.QuantileBalancer(E, K, bins=1000, group=solo)
    for seed in (3, 4, 5):
        good.route(_qb_scores(r, seed))
        ref.route(torch.cat([_qb_scores(i, seed) for i in range(R)]))
        good.step()
        ref.step()
        assert torch.equal(good.bias, ref.bias), (seed, good.bias, ref.bias)
    assert good.bias.any() and int(good.num_steps) == 3
