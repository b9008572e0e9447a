"""Ranks that end up in different collectives, on both host transports (run by tests/mp/test_mp_faults.py
at 2 and 3 ranks).  gloo pairs collectives by order and used to end a process (C++ ``terminate``: "Received
data size doesn't match expected size"); every scenario must instead end with MoonepError on every rank
within the timeout, every process alive (the launch fails otherwise), and a fresh instance must then work.

* the last rank builds a second instance while the others dispatch;
* the last rank closes its instance and builds a new one while the others dispatch;
* an exception in a backward hook on the last rank (it skips the rest of the backward and steps on);
* Ctrl-C on the last rank in the middle of a dispatch, then a retry: refused at once there, the peers'
  wait ends at the timeout;
* a LatentMoE training loop (max_tokens=None: EPProvider's sizing; QuantileBalancer.step) whose last rank
  skips the rest of a backward after a hook's exception.

On the torch transport the headers (moonep.transport.host_group) make the first four end at once; on mpi,
where headers and data move point to point, the waits end at the timeout instead.
"""
import time

import torch

import moonep
from faults_common import expect_moonep_error, isolated
from interrupts_common import Injected, checked_step, interrupt_at, make_ep, problem, train_step, transports
from tests.harness.mp import SkipCase
from tests.harness.mprun import quiet_barrier

T = 2.0
SLACK = 2.5  # on top of T (2 cores shared by 3 ranks)


def _timed(what, sub, dt):
    print(f"timing: {what} rank {sub.rank}/{sub.world_size}: {dt:.3f}s", flush=True)


def _expect(what, sub, fn, *needles):
    msg, dt = expect_moonep_error(fn, *needles, within=T + SLACK)
    _timed(what, sub, dt)
    return msg


def _fresh_step(rt, sub, transport, seed, eps=()):
    """After the fault: every rank is past it; a new instance (torch after a timeout: on a new group) works."""
    for ep in eps:
        ep.close()
    quiet_barrier(rt.comm)
    fresh = isolated(rt, timeout=T) if transport == "torch" else sub
    ep = make_ep(fresh, transport, T)
    checked_step(fresh, ep, seed)
    ep.close()


def _build_while_the_others_dispatch(rt, close_first: bool):
    """The last rank builds an instance (after closing its own when ``close_first``), the others dispatch."""
    if rt.world_size == 1:
        return
    what = "rebuilds" if close_first else "builds"
    for transport in transports(rt):
        sub = isolated(rt, timeout=T)
        ep = make_ep(sub, transport, T)
        if close_first:
            checked_step(sub, ep, 3)
        p, _, _ = problem(sub, 4, ep.num_experts)
        if sub.rank == sub.world_size - 1:
            if close_first:
                ep.close()
            _expect(f"{transport} {what} while peers dispatch, the builder", sub, lambda: make_ep(sub, transport, T),
                    "ExpertParallel")
        else:
            _expect(f"{transport} {what} while peers dispatch, a dispatcher", sub,
                    lambda: ep.dispatch(p["x"], p["idx"], p["w"]), "dispatch #")
        _fresh_step(rt, sub, transport, 5, [ep])


def case_one_rank_builds_an_instance_while_the_others_dispatch(rt):
    _build_while_the_others_dispatch(rt, close_first=False)


def case_one_rank_closes_and_rebuilds_while_the_others_dispatch(rt):
    _build_while_the_others_dispatch(rt, close_first=True)


class HookError(Exception):
    pass


def case_exception_in_a_backward_hook_on_one_rank(rt):
    """The hook on the experts' output raises on the last rank, after combine's backward: that rank skips
    the prefetches' and dispatch's backward passes and makes its next dispatch, the others are in them."""
    if rt.world_size == 1:
        return
    for transport in transports(rt):
        sub = isolated(rt, timeout=T)
        ep = make_ep(sub, transport, T)
        p, _, _ = problem(sub, 6, ep.num_experts)
        h = ep.dispatch(p["x"], p["idx"], p["w"])
        w1s, w2s = ep.prefetch(h, p["w1"].requires_grad_()), ep.prefetch(h, p["w2"].requires_grad_())
        out = torch.tanh(h.tokens @ w1s[0]) @ w2s[0]  # any differentiable function of the slot weights
        if sub.rank == sub.world_size - 1:
            out.register_hook(lambda g: (_ for _ in ()).throw(HookError("hook")))
        y = ep.combine(out, h)
        if sub.rank == sub.world_size - 1:
            try:
                y.backward(p["gy"])
            except HookError:
                pass
            else:
                raise AssertionError("the hook did not raise")
            _expect(f"{transport} next dispatch after a hook's error", sub,
                    lambda: ep.dispatch(p["x"].detach(), p["idx"], p["w"]), "dispatch #")
        else:
            _expect(f"{transport} backward of a peer whose hook raised", sub, lambda: y.backward(p["gy"]),
                    ".backward #")
        _fresh_step(rt, sub, transport, 7, [ep])


def _backward_then_error(ep, p):
    try:
        train_step(ep, p)
    except moonep.MoonepError:
        raise
    raise AssertionError("the step completed although a peer left it")


def case_interrupt_in_a_dispatch_then_retry(rt):
    """Ctrl-C on the last rank after the dispatch's header: its retry is refused at once (never paired with
    the peers' collectives), the peers raise at the timeout."""
    if rt.world_size == 1:
        return
    if rt.backend == "nccl":  # the peers would wait in NCCL collectives that only NCCL's watchdog ends
        raise SkipCase("a rank leaving a call part way on NCCL: see docs/reliability.md")
    for transport in transports(rt):
        sub = isolated(rt, timeout=T)
        p, _, _ = problem(sub, 8, 2 * sub.world_size)
        victim = sub.rank == sub.world_size - 1
        ep = make_ep(sub, transport, T)
        if victim:
            with interrupt_at(2):  # dispatch's header is collective #1, the counts' all-gather #2
                try:
                    train_step(ep, p)
                except Injected:
                    pass
                else:
                    raise AssertionError("not interrupted")
            for i in range(2):
                t0 = time.monotonic()
                msg = _expect(f"{transport} retry {i + 1} after Ctrl-C", sub,
                              lambda: ep.dispatch(p["x"], p["idx"], p["w"]), "refused", "Injected")
                assert time.monotonic() - t0 < 0.5, msg
        else:
            with interrupt_at(2, late=0.1, interrupt=False):  # the victim waits at #2 (mpi) when interrupted
                _expect(f"{transport} peer of an interrupted rank", sub, lambda: _backward_then_error(ep, p),
                        "dispatch #1")
        _fresh_step(rt, sub, transport, 9, [ep])


def _latent_moe(sub, transport):
    torch.manual_seed(0)
    return moonep.LatentMoE(16, 8, 2 * sub.world_size, 2, 8, num_shared=1, group=sub, dtype=torch.float64,
                            transport=transport, timeout=T)


def case_latent_moe_rank_skips_part_of_a_backward(rt):
    """A LatentMoE training loop with max_tokens=None (its EPProvider sizes by a header exchange in every
    forward) and a QuantileBalancer: the last rank's hook raises at the start of a backward; it goes on to
    the balancer's step (or the next forward) while the others are in that backward."""
    if rt.world_size == 1:
        return
    hooked = rt.world_size - 1
    for transport in transports(rt):
        for then in ("balancer", "forward"):
            sub = isolated(rt, timeout=T)
            layer = _latent_moe(sub, transport)
            x = torch.randn(5 + sub.rank, 16, dtype=torch.float64, device=sub.device, requires_grad=True)
            layer(x).sum().backward()  # a good step
            layer.balancer.step()
            y = layer(x)
            if sub.rank == hooked:
                y.register_hook(lambda g: (_ for _ in ()).throw(HookError("hook")))

            def step_on():
                if sub.rank != hooked:
                    y.sum().backward()
                    raise AssertionError("the backward completed although a peer skipped it")
                try:
                    y.sum().backward()
                except HookError:
                    pass
                if then == "balancer":
                    layer.balancer.step()
                layer(x)

            needles = ["QuantileBalancer.step" if then == "balancer" else "sizing"] if sub.rank == hooked else []
            _expect(f"{transport} LatentMoE, a rank skips a backward for the {then}", sub, step_on, *needles)
            quiet_barrier(rt.comm)
            fresh = isolated(rt, timeout=T)
            layer = _latent_moe(fresh, transport)
            layer(x).sum().backward()
            layer.balancer.step()
