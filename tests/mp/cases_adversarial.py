"""Adversarial arguments: valid on each rank but disagreeing across ranks, and checks that fail on one rank.

Run by tests/mp/test_mp_adversarial.py at 2, 3 and 4 CPU ranks over both host transports ("mpi", "torch",
float64 tokens), and by tests/gpu/cases_adversarial_gpu.py on the nvlink backend (float32 tokens).  Every
case asserts, for each transport:

* the error on every rank: ``ValueError`` with the argument's name and, for a disagreement, every rank's
  value (``"topk_weights: expected the same value on every rank, got rank 0: dtype torch.float64; ..."``);
  for a local check, the failing rank's own message and ``"{that message} (on rank r)"`` on the others.
  The outcome of every rank is gathered, so a rank that does not raise fails the case on every rank;
* the time to raise (``time.perf_counter`` around the call), below ``BOUND`` on every rank, far from the
  timeouts (60 s); rank 0 prints ``TIMING <case> <transport> <seconds>`` (the slowest rank, the slowest
  refusal of the case);
* that the next valid step on the same instance gives correct values: dispatch -> prefetch -> experts ->
  combine -> backward, against the dense float64 reference (``ep_reference``).

Few ExpertParallel instances are built (one per transport, shared by all cases, plus a second one for the
"handle of another instance" case), so the sequence numbers of one instance go through every refusal of
the file and must stay in step.
"""
import os
import time

import torch

import moonep
from ep_reference import dense_reference, make_problem, run_slots
from layers_reference import dense_latent_moe
from moonep.layers import LatentMoE
from moonep.training import full_state_dict

E, K, H, S, F = 12, 2, 16, 8, 4   # E divisible by 2, 3 and 4
BOUND = 5.0                       # seconds; the timeouts are 60 s
SEED = 7


def transports(rt):
    """The transports this run covers: both host transports on CPU ranks, the nvlink backend on CUDA
    ranks.  MOONEP_TEST_TRANSPORT overrides the list (as in cases_ep.py)."""
    if os.environ.get("MOONEP_TEST_TRANSPORT"):
        return os.environ["MOONEP_TEST_TRANSPORT"].split(",")
    return ["mpi", "torch"] if rt.device.type == "cpu" else ["nvlink"]


def _sizes(R):
    """Tokens per rank: one rank at capacity, for R >= 3 one rank without any token."""
    return [(S, 5, 0, 7)[r % 4] for r in range(R)]


def _gather(rt, obj):
    """Every rank's ``obj``; through MPI's world communicator (not the transports' gloo group or messages)."""
    if rt.comm is not None:
        return rt.comm.allgather(obj)
    import torch.distributed as dist

    out = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.cpu_group)
    return out


class _Env:
    """One transport's ExpertParallel and this rank's part of a global problem, with its dense reference."""

    def __init__(self, rt, transport):
        R = rt.world_size
        self.rt, self.transport, self.dev, self.R = rt, transport, rt.device, R
        self.nv = transport == "nvlink"
        self.dt = torch.float32 if self.nv else torch.float64       # token and weight dtype
        self.other = torch.bfloat16 if self.nv else torch.float32    # a different dtype the backend accepts
        self.tol = dict(rtol=2e-5, atol=2e-5) if self.dt == torch.float32 else dict(rtol=0, atol=1e-10)
        self.ep = moonep.ExpertParallel(rt, num_experts=E, topk=K, hidden=H, max_tokens=S, dtype=self.dt,
                                        transport=transport)
        assert self.ep.transport_name == transport, (self.ep.transport_name, transport)
        self._ep2 = None
        self.epn, self.cap = E // R, self.ep.capacity
        self.sizes = _sizes(R)
        self.T = sum(self.sizes)
        x, idx, w, w1, w2, gy = make_problem(SEED, R, E, K, H, F, self.sizes, "hot", dtype=torch.float64)
        start = sum(self.sizes[:rt.rank])
        self.sl = slice(start, start + self.sizes[rt.rank])
        self.home = slice(rt.rank * self.epn, (rt.rank + 1) * self.epn)
        d = dict(device=self.dev, dtype=self.dt)
        self.x, self.w, self.gy = x[self.sl].to(**d), w[self.sl].to(**d), gy[self.sl].to(**d)
        self.idx = idx[self.sl].to(self.dev)
        self.w1, self.w2 = w1[self.home].to(**d), w2[self.home].to(**d)
        # The reference: the whole global batch in one process, float64.
        rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
        r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        ry = dense_reference(rx, idx, rw, r1, r2)
        (ry * gy).sum().backward()
        self.ref = dict(y=ry[self.sl].detach(), dx=rx.grad[self.sl], dtopk_weights=rw.grad[self.sl],
                        dW1=r1.grad[self.home], dW2=r2.grad[self.home])

    @property
    def ep2(self):
        """A second ExpertParallel of the same configuration (built collectively on first use)."""
        if self._ep2 is None:
            self._ep2 = moonep.ExpertParallel(self.rt, num_experts=E, topk=K, hidden=H, max_tokens=S,
                                              dtype=self.dt, transport=self.transport)
        return self._ep2

    def handle(self, ep=None):
        """A plain (no autograd) dispatch of this rank's tokens."""
        return (ep or self.ep).dispatch(self.x, self.idx, self.w)

    def rows(self, dtype=None, width=H, n=None):
        """Some expert output ``[cap, width]`` (a fresh tensor, never a view of a receive buffer)."""
        g = torch.Generator().manual_seed(100 + self.rt.rank)
        return torch.randn(self.cap if n is None else n, width, generator=g,
                           dtype=torch.float64).to(device=self.dev, dtype=dtype or self.dt)

    def valid_step(self, what, num_global_tokens=None):
        """dispatch -> prefetch (two projections) -> experts -> combine -> backward, against the reference."""
        ep, ctx = self.ep, f"rank {self.rt.rank}/{self.R} {self.transport} after {what}"
        x, w = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        w1, w2 = self.w1.clone().requires_grad_(), self.w2.clone().requires_grad_()
        h = ep.dispatch(x, self.idx, w, num_global_tokens=num_global_tokens)
        w1s, w2s = ep.prefetch(h, w1), ep.prefetch(h, w2)
        out = run_slots(h.tokens, h.cu_seqlens.tolist(), w1s, w2s)
        y = ep.combine(out, h)
        (y * self.gy).sum().backward()
        if self.R > 1:  # "hot" routing: replicas exist, so prefetch and reduce_grad move data
            assert bool((h.plan.replica_experts >= 0).any()), ctx
        for name, got in (("y", y), ("dx", x.grad), ("dtopk_weights", w.grad), ("dW1", w1.grad),
                          ("dW2", w2.grad)):
            torch.testing.assert_close(got.detach().double().cpu(), self.ref[name], **self.tol,
                                       msg=lambda m, name=name: f"{name} {ctx}: {m}")


_ENVS: dict = {}


def _envs(rt):
    """One _Env per transport, built once per process (collectively: every rank runs the cases in order)."""
    out = []
    for t in transports(rt):
        if t not in _ENVS:
            _ENVS[t] = _Env(rt, t)
        out.append(_ENVS[t])
    return out


# -- the refusal checks --------------------------------------------------------------------------------
def _outcome(call):
    """Run ``call`` timed: ``(message of the ValueError or None, what else happened or None, seconds)``."""
    t0 = time.perf_counter()
    try:
        call()
    except ValueError as exc:
        return str(exc), None, time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001  (reported below, on every rank)
        return None, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
    return None, "returned without raising", time.perf_counter() - t0


def _all_raised(rt, got, what):
    bad = [f"rank {r}: {other}" for r, (msg, other, _) in enumerate(got) if msg is None]
    assert not bad, f"{what}: expected ValueError on every rank, but " + "; ".join(bad) + f" (seen on rank {rt.rank})"
    slow = [f"rank {r}: {t:.3f}s" for r, (_, _, t) in enumerate(got) if t >= BOUND]
    assert not slow, f"{what}: raised after more than {BOUND}s: " + "; ".join(slow)
    return max(t for _, _, t in got)


def disagree(env, call, arg, values, what):
    """``call`` (each rank its own arguments) must raise on every rank
    ``"{arg}: expected the same value on every rank, got rank 0: {values[0]}; rank 1: ..."``."""
    msg, other, t = _outcome(call)
    got = _gather(env.rt, (msg, other, t))
    secs = _all_raised(env.rt, got, what)
    want = f"{arg}: expected the same value on every rank, got " + "; ".join(
        f"rank {r}: {v}" for r, v in enumerate(values))
    for r, (m, _, _) in enumerate(got):
        assert m == want, f"{what}: rank {r} raised {m!r}, expected {want!r} (seen on rank {env.rt.rank})"
    return secs


def one_rank_fails(env, call, bad, prefix, what):
    """``call`` fails a local check on rank ``bad`` only: that rank raises its own message (starting with
    ``prefix``), every other rank ``"{that message} (on rank {bad})"``."""
    msg, other, t = _outcome(call)
    got = _gather(env.rt, (msg, other, t))
    secs = _all_raised(env.rt, got, what)
    own = got[bad][0]
    assert own.startswith(prefix) and "(on rank" not in own, \
        f"{what}: rank {bad} raised {own!r}, expected {prefix!r}..."
    for r, (m, _, _) in enumerate(got):
        want = own if r == bad else f"{own} (on rank {bad})"
        assert m == want, f"{what}: rank {r} raised {m!r}, expected {want!r} (seen on rank {env.rt.rank})"
    return secs


def _timing(rt, case, transport, secs):
    if rt.rank == 0:
        print(f"TIMING {case} {transport} {max(secs):.4f}", flush=True)


def _dt(env, r, bad, odd):
    return f"dtype {odd if r == bad else env.dt}"


# -- dispatch: arguments that disagree -----------------------------------------------------------------
def case_dispatch_weights_dtype_differs(rt):
    """topk_weights in another float dtype on one rank (was: a segfault or wrong values)."""
    R = rt.world_size
    for env in _envs(rt):
        bad, secs = R - 1, []
        w = env.w.to(env.other) if rt.rank == bad else env.w
        secs.append(disagree(env, lambda: env.ep.dispatch(env.x, env.idx, w), "topk_weights",
                             [_dt(env, r, bad, env.other) for r in range(R)], "topk_weights dtype"))
        env.valid_step("topk_weights dtype differing")
        _timing(rt, "dispatch_weights_dtype_differs", env.transport, secs)


def case_dispatch_requires_grad_on_one_rank(rt):
    """x.requires_grad (then topk_weights.requires_grad) true on one rank only: the backward collectives
    would not pair up (was: weight gradients wrong by ~10)."""
    R = rt.world_size
    for env in _envs(rt):
        secs = []
        bad = 0
        x = env.x.clone().requires_grad_(rt.rank == bad)
        secs.append(disagree(env, lambda: env.ep.dispatch(x, env.idx, env.w), "x",
                             [f"requires_grad={r == bad}" for r in range(R)], "x.requires_grad"))
        bad = R - 1
        w = env.w.clone().requires_grad_(rt.rank == bad)
        secs.append(disagree(env, lambda: env.ep.dispatch(env.x, env.idx, w), "topk_weights",
                             [f"requires_grad={r == bad}" for r in range(R)], "topk_weights.requires_grad"))
        # Under no_grad the flags do not matter: the same call is valid then.
        with torch.no_grad():
            h = env.ep.dispatch(x, env.idx, w)
        assert not h.tokens.requires_grad
        env.valid_step("requires_grad on one rank")
        _timing(rt, "dispatch_requires_grad_on_one_rank", env.transport, secs)


def case_dispatch_num_global_tokens_disagree(rt):
    """num_global_tokens given on one rank only, then values differing (one rank gives the right total)."""
    R = rt.world_size
    for env in _envs(rt):
        T, secs = env.T, []
        bad = 0
        n = T if rt.rank == bad else None
        secs.append(disagree(env, lambda: env.ep.dispatch(env.x, env.idx, env.w, num_global_tokens=n),
                             "num_global_tokens", [repr(T) if r == bad else "None" for r in range(R)],
                             "num_global_tokens on one rank"))
        bad = R - 1
        n = T + 1 if rt.rank == bad else T
        secs.append(disagree(env, lambda: env.ep.dispatch(env.x, env.idx, env.w, num_global_tokens=n),
                             "num_global_tokens", [repr(T + 1 if r == bad else T) for r in range(R)],
                             "num_global_tokens differing"))
        env.valid_step("num_global_tokens disagreeing", num_global_tokens=T)
        _timing(rt, "dispatch_num_global_tokens_disagree", env.transport, secs)


# -- combine: arguments that disagree ------------------------------------------------------------------
def case_combine_expert_out_width_differs(rt):
    """expert_out one column wider on one rank (was: garbage split sizes, then a crash)."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        out = env.rows(width=H + 1 if rt.rank == bad else H)
        secs = [disagree(env, lambda: env.ep.combine(out, h), "expert_out",
                         [f"shape {[env.cap, H + 1 if r == bad else H]}" for r in range(R)], "expert_out width")]
        env.valid_step("expert_out width differing")
        _timing(rt, "combine_expert_out_width_differs", env.transport, secs)


def case_combine_expert_out_dtype_differs(rt):
    """expert_out in another float dtype on one rank (was: values wrong by up to 1e38, or NaN)."""
    R = rt.world_size
    for env in _envs(rt):
        bad = 0
        h = env.handle()
        out = env.rows(dtype=env.other if rt.rank == bad else env.dt)
        secs = [disagree(env, lambda: env.ep.combine(out, h), "expert_out",
                         [_dt(env, r, bad, env.other) for r in range(R)], "expert_out dtype")]
        env.valid_step("expert_out dtype differing")
        _timing(rt, "combine_expert_out_dtype_differs", env.transport, secs)


def case_combine_handle_of_older_dispatch_on_one_rank(rt):
    """One rank combines with the handle of the previous dispatch, the others with the latest one."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        old, new = env.handle(), env.handle()
        h = old if rt.rank == bad else new
        out = env.rows()
        secs = [disagree(env, lambda: env.ep.combine(out, h), "h",
                         [f"dispatch #{env.ep._step_of(old if r == bad else new).routing.step}" for r in range(R)],
                         "combine with an older handle")]
        # the same on prefetch and reduce_grad
        secs.append(disagree(env, lambda: env.ep.prefetch(h, env.w1), "h",
                             [f"dispatch #{env.ep._step_of(old if r == bad else new).routing.step}" for r in range(R)],
                             "prefetch with an older handle"))
        g = torch.zeros(2 * env.epn, H, F, dtype=env.dt, device=env.dev)
        secs.append(disagree(env, lambda: env.ep.reduce_grad(h, g), "h",
                             [f"dispatch #{env.ep._step_of(old if r == bad else new).routing.step}" for r in range(R)],
                             "reduce_grad with an older handle"))
        env.valid_step("a handle of an older dispatch")
        _timing(rt, "combine_handle_of_older_dispatch_on_one_rank", env.transport, secs)


# -- prefetch and reduce_grad: arguments that disagree -------------------------------------------------
def case_prefetch_weight_shape_differs(rt):
    """local_weight with another trailing shape on one rank."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        lw = torch.zeros(env.epn, H, F + 1, dtype=env.dt, device=env.dev) if rt.rank == bad else env.w1
        secs = [disagree(env, lambda: env.ep.prefetch(h, lw), "local_weight",
                         [f"shape {[env.epn, H, F + 1 if r == bad else F]}" for r in range(R)],
                         "local_weight trailing shape")]
        env.valid_step("local_weight shape differing")
        _timing(rt, "prefetch_weight_shape_differs", env.transport, secs)


def case_prefetch_weight_dtype_differs(rt):
    """local_weight in another dtype on one rank."""
    R = rt.world_size
    for env in _envs(rt):
        bad = 0
        h = env.handle()
        lw = env.w1.to(env.other) if rt.rank == bad else env.w1
        secs = [disagree(env, lambda: env.ep.prefetch(h, lw), "local_weight",
                         [_dt(env, r, bad, env.other) for r in range(R)], "local_weight dtype")]
        env.valid_step("local_weight dtype differing")
        _timing(rt, "prefetch_weight_dtype_differs", env.transport, secs)


def case_prefetch_out_on_one_rank_only(rt):
    """prefetch(h, w, out=pool) (removed) on one rank, prefetch(h, w) on the others; then
    local_weight.requires_grad on one rank only (which decides whether reduce_grad runs in the backward)."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        pool = torch.zeros(2 * env.epn, H, F, dtype=env.dt, device=env.dev)
        kw = dict(out=pool) if rt.rank == bad else {}
        secs = [one_rank_fails(env, lambda: env.ep.prefetch(h, env.w1, **kw), bad,
                               "out: expected None (prefetch(out=...) was removed", "out= on one rank")]
        bad = 0
        lw = env.w1.clone().requires_grad_(rt.rank == bad)
        secs.append(disagree(env, lambda: env.ep.prefetch(h, lw), "local_weight",
                             [f"requires_grad={r == bad}" for r in range(R)], "local_weight.requires_grad"))
        env.valid_step("out= on one rank only")
        _timing(rt, "prefetch_out_on_one_rank_only", env.transport, secs)


def case_reduce_grad_grad_view_disagrees(rt):
    """grad_view with another trailing shape, then another dtype, on one rank."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        g = torch.zeros(2 * env.epn, H, F + 1 if rt.rank == bad else F, dtype=env.dt, device=env.dev)
        secs = [disagree(env, lambda: env.ep.reduce_grad(h, g), "grad_view",
                         [f"shape {[2 * env.epn, H, F + 1 if r == bad else F]}" for r in range(R)],
                         "grad_view trailing shape")]
        bad = 0
        g = torch.zeros(2 * env.epn, H, F, dtype=env.other if rt.rank == bad else env.dt, device=env.dev)
        secs.append(disagree(env, lambda: env.ep.reduce_grad(h, g), "grad_view",
                             [_dt(env, r, bad, env.other) for r in range(R)], "grad_view dtype"))
        env.valid_step("grad_view disagreeing")
        _timing(rt, "reduce_grad_grad_view_disagrees", env.transport, secs)


# -- local checks that fail on one rank ----------------------------------------------------------------
def case_local_check_fails_on_one_rank_dispatch(rt):
    """x of the wrong width, then topk_idx of the wrong shape, on one rank (R >= 3: a rank without tokens)."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        s, sb = env.x.shape[0], env.sizes[bad]  # the bad rank's token count is in its message
        x = torch.zeros(s, H + 1, dtype=env.dt, device=env.dev) if rt.rank == bad else env.x
        secs = [one_rank_fails(env, lambda: env.ep.dispatch(x, env.idx, env.w), bad,
                               f"x: expected shape [s, {H}], got [{sb}, {H + 1}]", "x width")]
        bad = 0
        sb = env.sizes[bad]
        idx = torch.zeros(s, K + 1, dtype=torch.int64, device=env.dev) if rt.rank == bad else env.idx
        secs.append(one_rank_fails(env, lambda: env.ep.dispatch(env.x, idx, env.w), bad,
                                   f"topk_idx: expected shape [{sb}, {K}], got [{sb}, {K + 1}]", "topk_idx shape"))
        # a sparse x passed every check of its own and failed inside the exchange on that rank alone (its
        # peers waited out the timeout, and the instance refused every later call)
        bad = R - 1
        x = env.x.to_sparse() if rt.rank == bad else env.x
        secs.append(one_rank_fails(env, lambda: env.ep.dispatch(x, env.idx, env.w), bad,
                                   "x: expected a dense (strided) tensor, got a torch.sparse_coo tensor", "sparse x"))
        env.valid_step("a failed local check in dispatch")
        _timing(rt, "local_check_fails_on_one_rank_dispatch", env.transport, secs)


def case_local_check_fails_on_one_rank_combine(rt):
    """expert_out with one row too few on one rank (was: the peers failed with a call-order error)."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        out = env.rows(n=env.cap - 1 if rt.rank == bad else env.cap)
        secs = [one_rank_fails(env, lambda: env.ep.combine(out, h), bad,
                               f"expert_out: expected shape [{env.cap}, *]", "expert_out rows")]
        env.valid_step("a failed local check in combine")
        _timing(rt, "local_check_fails_on_one_rank_combine", env.transport, secs)


def case_local_check_fails_on_one_rank_prefetch(rt):
    """local_weight with epn + 1 experts on one rank."""
    for env in _envs(rt):
        bad = 0
        h = env.handle()
        lw = torch.zeros(env.epn + 1, H, F, dtype=env.dt, device=env.dev) if rt.rank == bad else env.w1
        secs = [one_rank_fails(env, lambda: env.ep.prefetch(h, lw), bad,
                               f"local_weight: expected shape [epn={env.epn}, ...]", "local_weight first dim")]
        env.valid_step("a failed local check in prefetch")
        _timing(rt, "local_check_fails_on_one_rank_prefetch", env.transport, secs)


def case_local_check_fails_on_one_rank_reduce_grad(rt):
    """grad_view with 2*epn - 1 slots on one rank."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h = env.handle()
        g = torch.zeros(2 * env.epn - (rt.rank == bad), H, F, dtype=env.dt, device=env.dev)
        secs = [one_rank_fails(env, lambda: env.ep.reduce_grad(h, g), bad,
                               f"grad_view: expected shape [2*epn={2 * env.epn}, ...]", "grad_view first dim")]
        env.valid_step("a failed local check in reduce_grad")
        _timing(rt, "local_check_fails_on_one_rank_reduce_grad", env.transport, secs)


def case_handle_of_another_instance_on_one_rank(rt):
    """One rank passes the Dispatched of another ExpertParallel (another layer) to combine, prefetch and
    reduce_grad; the others their own."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        h_own, h_other = env.handle(), env.handle(env.ep2)
        h = h_other if rt.rank == bad else h_own
        pre = "h: expected a Dispatched of this ExpertParallel"
        secs = [one_rank_fails(env, lambda: env.ep.combine(env.rows(), h), bad, pre, "combine, other instance")]
        secs.append(one_rank_fails(env, lambda: env.ep.prefetch(h, env.w1), bad, pre, "prefetch, other instance"))
        g = torch.zeros(2 * env.epn, H, F, dtype=env.dt, device=env.dev)
        secs.append(one_rank_fails(env, lambda: env.ep.reduce_grad(h, g), bad, pre, "reduce_grad, other instance"))
        env.valid_step("a handle of another instance")
        # the other instance is unharmed too
        y = env.ep2.combine(h_other.tokens.clone(), h_other)
        assert y.shape == env.x.shape
        _timing(rt, "handle_of_another_instance_on_one_rank", env.transport, secs)


def case_handle_fields_replaced_on_one_rank(rt):
    """The last rank's Dispatched has a field replaced: ``h.weights`` sliced one row short (was read out of
    bounds), ``h.weights`` of the step before (the same shape: was a silently wrong sum), ``h.step`` replaced
    by a tensor that is no step token.  Refused on every rank, naming the field;
    the next step is right."""
    R = rt.world_size
    for env in _envs(rt):
        bad = R - 1
        before, h = env.handle(), env.handle()

        def replaced(**fields):
            if rt.rank != bad:
                return h
            return h._replace(**fields)

        pre = "h.weights: expected the tensor dispatch returned"
        secs = [one_rank_fails(env, lambda: env.ep.combine(env.rows(), replaced(weights=h.weights[:-1])), bad, pre,
                               "combine, h.weights sliced")]
        if not env.nv:  # nvlink zero-copy: both steps' weights are views of one receive buffer (this step's values)
            secs.append(one_rank_fails(env, lambda: env.ep.combine(env.rows(), replaced(weights=before.weights)),
                                       bad, pre, "combine, h.weights of another step"))
        junk = torch.zeros_like(h.step)  # no step token: the registry knows no such step
        secs.append(one_rank_fails(env, lambda: env.ep.prefetch(replaced(step=junk), env.w1), bad,
                                   "h.step: expected the step token", "prefetch, h.step replaced"))
        env.valid_step("replaced handle fields")
        _timing(rt, "handle_fields_replaced_on_one_rank", env.transport, secs)


def case_bad_routing_values_on_one_rank(rt):
    """Smoke test of the value checks (covered in cases_ep.py/cases_faults.py): an expert id out of range on
    one rank is refused on every rank; the next step works."""
    for env in _envs(rt):
        if env.nv:  # nvlink checks values on the device and reports them later (tests/gpu/cases_ep_gpu.py)
            continue  # (the GPU file skips this case)
        bad = 0  # rank 0 always has tokens
        idx = env.idx.clone()
        if rt.rank == bad:
            idx[0, 0] = E
        secs = [one_rank_fails(env, lambda: env.ep.dispatch(env.x, idx, env.w), bad,
                               "topk_idx: expected expert ids in [-1", "expert id out of range")]
        env.valid_step("a bad expert id")
        _timing(rt, "bad_routing_values_on_one_rank", env.transport, secs)


# -- LatentMoE ---------------------------------------------------------------------------------------
def case_latent_moe_bad_x_on_one_rank(rt):
    """LatentMoE with x of the wrong width, the wrong dtype, a sparse x, then an error in the router, on one
    rank: every rank raises at that forward (was: the peers completed silently, paired with the bad rank's next
    call); the next forward of the same input equals the one before, bitwise, and the dense float64 model."""
    R = rt.world_size
    for env in _envs(rt):
        torch.manual_seed(0)
        m = LatentMoE(H, 8, E, K, 8, num_shared=1, group=rt, dtype=env.dt, device=env.dev,
                      transport=env.transport)
        x = env.x
        y0 = m(x)
        qb = m.balancer
        before = [t.clone() for t in (qb.bias, qb.num_steps, qb._counts, qb._lo, qb._width)], qb._recording
        bad = R - 1
        xb = x[:, :H - 1] if rt.rank == bad else x
        secs = [one_rank_fails(env, lambda: m(xb), bad,
                               f"x: expected shape [..., d_model={H}], got [{env.sizes[bad]}, {H - 1}]",
                               "LatentMoE x width")]
        bad = 0
        xb = x.to(env.other) if rt.rank == bad else x
        secs.append(one_rank_fails(env, lambda: m(xb), bad,
                                   f"x: expected dtype {env.dt} (the layer's parameters), got {env.other}",
                                   "LatentMoE x dtype"))
        bad = R - 1
        xb = x.to_sparse() if rt.rank == bad else x
        secs.append(one_rank_fails(env, lambda: m(xb), bad,
                                   "x: expected a dense (strided) tensor, got a torch.sparse_coo tensor",
                                   "LatentMoE sparse x"))
        # any other error on one rank before the exchange (here the router's): that rank raises it, the others
        # a ValueError naming it (was: it left the peers' forward paired with its next call)
        bad = 0
        router = m._select
        if rt.rank == bad:
            m._select = lambda x_r: (_ for _ in ()).throw(RuntimeError("out of memory, say"))
        msg, other, t = _outcome(lambda: m(x))
        m._select = router
        got = _gather(rt, (msg, other, t))
        for r, (msg, other, t) in enumerate(got):
            want = (None, "RuntimeError: out of memory, say") if r == bad else \
                (f"RuntimeError: out of memory, say (on rank {bad})", None)
            assert (msg, other) == want and t < BOUND, f"router error on rank {bad}: rank {r} got {(msg, other, t)}"
        secs.append(max(t for *_, t in got))
        # a forward refused on every rank leaves every rank's balancer as it was (nothing recorded)
        after = [t.clone() for t in (qb.bias, qb.num_steps, qb._counts, qb._lo, qb._width)], qb._recording
        assert after[1] == before[1] and all(torch.equal(a, b) for a, b in zip(after[0], before[0])), \
            f"rank {rt.rank} {env.transport}: the refused forwards changed the balancer's state"
        y1 = m(x)
        assert torch.equal(y0, y1), f"rank {rt.rank} {env.transport}: output after the refusals differs bitwise"
        y1.sum().backward()  # the backward collectives pair up too
        # and the output is the dense model's
        full = full_state_dict(m)
        p = {k: v.detach().double().cpu() for k, v in full.items()
             if k != "balancer.bias" and not k.endswith("num_steps")}
        xg, *_ = make_problem(SEED, R, E, K, H, F, env.sizes, "hot", dtype=torch.float64)
        bias = m.balancer.bias.detach().cpu() if m.balancer is not None else None
        ry = dense_latent_moe(p, xg, K, bias)[env.sl]
        tol = dict(rtol=0, atol=1e-10) if env.dt == torch.float64 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y1.detach().double().cpu(), ry, **tol,
                                   msg=lambda msg: f"LatentMoE rank {rt.rank} {env.transport}: {msg}")
        _timing(rt, "latent_moe_bad_x_on_one_rank", env.transport, secs)


# -- several refusals in a row -------------------------------------------------------------------------
def case_many_refusals_in_a_row_then_valid_step(rt):
    """Eight refusals of every kind in a row on one instance (different bad ranks), then a valid step:
    the sequence numbers stay in step."""
    R = rt.world_size
    for env in _envs(rt):
        ep, secs = env.ep, []
        for i in range(2):  # twice round, so the bad rank moves
            bad = (R - 1 + i) % R
            me = rt.rank == bad
            w = env.w.to(env.other) if me else env.w
            secs.append(disagree(env, lambda: ep.dispatch(env.x, env.idx, w), "topk_weights",
                                 [_dt(env, r, bad, env.other) for r in range(R)], f"row {i}: dispatch dtype"))
            s = env.x.shape[0]
            x = torch.zeros(s, H + 1, dtype=env.dt, device=env.dev) if me else env.x
            secs.append(one_rank_fails(env, lambda: ep.dispatch(x, env.idx, env.w), bad, "x: expected shape",
                                       f"row {i}: dispatch x width"))
            h = env.handle()
            out = env.rows(width=H + 1 if me else H)
            secs.append(disagree(env, lambda: ep.combine(out, h), "expert_out",
                                 [f"shape {[env.cap, H + 1 if r == bad else H]}" for r in range(R)],
                                 f"row {i}: combine width"))
            out = env.rows(n=env.cap + 1 if me else env.cap)
            secs.append(one_rank_fails(env, lambda: ep.combine(out, h), bad, "expert_out: expected shape",
                                       f"row {i}: combine rows"))
            lw = env.w1.to(env.other) if me else env.w1
            secs.append(disagree(env, lambda: ep.prefetch(h, lw), "local_weight",
                                 [_dt(env, r, bad, env.other) for r in range(R)], f"row {i}: prefetch dtype"))
            lw = env.w1[:env.epn - 1] if me else env.w1
            secs.append(one_rank_fails(env, lambda: ep.prefetch(h, lw), bad, "local_weight: expected shape",
                                       f"row {i}: prefetch first dim"))
            g = torch.zeros(2 * env.epn, H, F + 1 if me else F, dtype=env.dt, device=env.dev)
            secs.append(disagree(env, lambda: ep.reduce_grad(h, g), "grad_view",
                                 [f"shape {[2 * env.epn, H, F + 1 if r == bad else F]}" for r in range(R)],
                                 f"row {i}: reduce_grad shape"))
            g = torch.zeros(2 * env.epn + 1, H, F, dtype=env.dt, device=env.dev) if me else g.new_zeros(
                2 * env.epn, H, F)
            secs.append(one_rank_fails(env, lambda: ep.reduce_grad(h, g), bad, "grad_view: expected shape",
                                       f"row {i}: reduce_grad first dim"))
        env.valid_step("sixteen refusals in a row")
        env.valid_step("sixteen refusals in a row, a second step")
        _timing(rt, "many_refusals_in_a_row_then_valid_step", env.transport, secs)
