"""Collective-order checks and failure bookkeeping.  The header goes through the host transport, or, for
the nvlink backend, through host shared memory (:mod:`moonep.transport.order_board`).

Every collective call of an :class:`moonep.ExpertParallel` (dispatch, combine, prefetch, reduce_grad and
their backward passes) starts with a 4-word header exchange ``[magic, instance, op, seq]``.  When the
ranks disagree (one calls ``combine`` while the others call ``dispatch``, or two layers' calls interleave
differently) every rank sees all headers and raises the same :class:`moonep.MoonepError`, instead of
feeding mismatched collectives to MPI/gloo (a hang at best, silently wrong data at worst).  A peer that
never sends its header (dead or stalled) makes the exchange time out with an error naming the op.

The same header carries whether a rank's arguments failed its local checks, and the call's signature
(dtypes, trailing shapes, the step of a handle, which inputs require grad), so ``ExpertParallel`` refuses
a call on every rank together when they disagree.

Other host collectives on a gloo group (an instance's construction, ``EPProvider``'s sizing, a
``QuantileBalancer`` step, ``Runtime.barrier``...) start with a header of the same size, naming the call
(:mod:`moonep.transport.host_group`): gloo pairs collectives by order and ends a process when paired ones
move different sizes, so a rank in another call must be seen by content.  A call left part way on one
rank (an interrupt, an error between its collectives) makes that rank refuse every later call of the
instance (``ExpertParallel._leave``), instead of pairing it with the peers' collectives.

Set ``MOONEP_CHECK_ORDER=0`` to skip the header exchange (one tiny collective per call); timeouts still
name the op then, but a mismatched order or arguments that disagree across ranks are no longer detected
before the data moves (wrong values or a crash), and a local argument error raises on its rank only.
"""
from __future__ import annotations

import atexit
import signal
import sys

from .errors import MoonepError

MAGIC = 0x6D6F6F6E  # "moon": a header from anything else is reported as such
OPS = ("dispatch", "combine", "prefetch", "reduce_grad", "dispatch.backward", "combine.backward",
       "prefetch.backward", "sync")
_CODE = {name: i + 1 for i, name in enumerate(OPS)}
# The other host collectives on a gloo group start with a header of the same size (moonep.transport.
# host_group): [MAGIC, instance, code, seq, 0, payload...], so ranks in different calls see it by content.
(BUILD, GATHER, SIZING, BALANCER, AGREEMENT, SEED, BARRIER, CHECK_STATE, SYNC_GRADS, GRAD_NORM,
 GATHER_STATE, GENERATE_END) = range(len(OPS) + 1, len(OPS) + 13)
_OTHER = {BUILD: "ExpertParallel construction", GATHER: "all_gather_object", SIZING: "EPProvider sizing",
          BALANCER: "QuantileBalancer.step", AGREEMENT: "agreement", SEED: "seed broadcast", BARRIER: "barrier",
          CHECK_STATE: "the replicated-state check (moonep.training.prepare, patch_hf_moe, patch_generic)",
          SYNC_GRADS: "moonep.training.sync_grads", GRAD_NORM: "moonep.training.clip_grad_norm_",
          GATHER_STATE: "moonep.training.full_state_dict", GENERATE_END: "the end of generate()"}
SIG_WORDS = 8  # the call's signature: what must agree across ranks (dtypes, shapes, step, autograd pattern)
HEADER_WORDS = 5 + SIG_WORDS  # magic, instance, op, seq, refused, signature


def check_order_enabled() -> bool:
    """``MOONEP_CHECK_ORDER`` (default on); a value other than 0/1/true/false/yes/no/on/off raises
    ``ValueError`` naming the variable."""
    from .config import env_flag

    return env_flag("MOONEP_CHECK_ORDER", True)


class CallName:
    """The name of the collective a header starts (:func:`describe`), formatted only where a message uses it:
    every call sets the transport's ``current_op``, and only errors read it."""

    __slots__ = ("header",)

    def __init__(self, header):
        self.header = header

    def __str__(self) -> str:
        return describe(self.header)

    __repr__ = __str__


def describe(header) -> str:
    """``"combine #5"`` (plus the instance when it is not the first) for a header ``[magic, inst, op, seq, ...]``."""
    magic, inst, code, seq = (int(v) for v in header[:4])
    if magic == MAGIC and code == BUILD:
        return f"ExpertParallel #{inst} construction"
    if magic == MAGIC and code == GATHER:
        return f"an all_gather_object of call #{seq} of ExpertParallel #{inst}"
    if magic == MAGIC and code == BALANCER:
        return f"QuantileBalancer.step (balancer #{inst} of the group)"
    if magic == MAGIC and code in _OTHER:
        return _OTHER[code]
    if magic != MAGIC or not 1 <= code <= len(OPS):
        return f"an unknown collective (header {[magic, inst, code, seq]})"
    suffix = f" of ExpertParallel #{inst}" if inst else ""
    return f"{OPS[code - 1]} #{seq}{suffix}"


class OrderMismatch(MoonepError):
    """Ranks made different collective calls; every rank saw every header and raises this together, so the
    ranks stay in step (the group and the instances stay usable)."""


def check_same_call(headers, rank: int) -> None:
    """Raise :class:`OrderMismatch` unless every rank's header (rank order) names the same call: the
    same magic, instance, op and sequence number."""
    ref = [int(v) for v in headers[0][:4]]
    for r, h in enumerate(headers):
        if [int(v) for v in h[:4]] != ref:
            raise OrderMismatch(f"collective order mismatch: rank {r} called {describe(h)} while rank 0 called "
                                f"{describe(ref)} (seen on rank {rank}); every rank must make the same "
                                "collective calls in the same order")


class CollectiveGuard:
    """Numbers the collective calls of one ExpertParallel and checks that every rank makes the same one.

    ``instance`` is the ExpertParallel's index among those built on the same runtime (construction is
    collective, so it is the same on every rank); ``seq`` counts its collective calls.
    """

    def __init__(self, transport, rt, instance: int):
        self.transport, self.rt, self.instance = transport, rt, int(instance)
        self.seq = 0
        self.enabled = check_order_enabled()

    def enter(self, op: str, exchange=None, refused: bool = False, sig=()):
        """Start collective ``op``: label the transport's errors with it and check the order. Collective.

        ``exchange``: header all-gather to use instead of the transport's (the nvlink backend's host
        shared-memory board).  ``refused``: this rank's arguments failed a local check; ``sig``: up to
        ``SIG_WORDS`` ints that must be equal on every rank.  Both travel in the header, so the caller can
        refuse the call on every rank together.  Returns every rank's header (lists of ``HEADER_WORDS``
        ints, rank order), or ``None`` when nothing was exchanged (one rank, or ``MOONEP_CHECK_ORDER=0``).
        """
        self.seq += 1
        header = [MAGIC, self.instance, _CODE[op], self.seq, int(refused), *sig]
        header += [0] * (HEADER_WORDS - len(header))
        self.transport.current_op = CallName(header)
        self.transport.call = (self.instance, _CODE[op], self.seq)
        if not self.enabled or self.transport.world_size == 1:
            return None
        try:
            got = (exchange or self.transport.exchange_header)(header)
        except MoonepError:
            mark_failed(self.rt, self.transport.timeout_s())
            raise
        try:
            check_same_call(got, self.transport.rank)  # every rank completed the exchange: all raise together
        except OrderMismatch:
            # The call did not happen, on any rank: it takes no number.  A peer in another kind of call (an
            # EPProvider sizing, a balancer step) took none either, so the ranks stay in step.
            self.seq -= 1
            raise
        return got


_WATCHDOG = {"armed": False, "seconds": 0.0}


def mark_failed(rt, timeout_s: float) -> None:
    """Remember that a collective of ``rt`` failed: its shutdown skips barriers, and under mpirun the process
    is made to end even though ``MPI_Finalize`` would wait forever for a dead peer."""
    if rt is not None:
        rt.failed = True
    if "mpi4py.MPI" in sys.modules:  # launched by mpirun (mpi4py is imported only then)
        # Generous: a clean teardown must never be cut short; a hung one ends within this.
        arm_exit_watchdog(max(2.0 * float(timeout_s), 10.0))


def arm_exit_watchdog(seconds: float) -> None:
    """At interpreter exit, arm ``SIGALRM`` (default action: terminate) ``seconds`` ahead.

    Why: mpi4py calls ``MPI_Finalize`` at exit, which blocks forever on a dead peer (MPICH, auto-cleanup
    off).  Registered after mpi4py's own handler, so it runs first; a clean finalize simply exits before
    the alarm fires.
    """
    _WATCHDOG["seconds"] = max(_WATCHDOG["seconds"], seconds)
    if _WATCHDOG["armed"]:
        return
    _WATCHDOG["armed"] = True

    def _arm():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(_WATCHDOG["seconds"]) + 2)

    atexit.register(_arm)
