"""mpi4py transport: point-to-point messages on zero-copy numpy views of CPU tensors, polled with a timeout.

Every wait is a non-blocking call polled against a deadline (``timeout``), so a dead or stalled peer
raises :class:`moonep.MoonepError` naming the op (``current_op``) and, where a message is missing, the
peers that never sent, instead of blocking forever (blocking MPI calls have no timeout).

Why point to point and not MPI collectives: collectives on a communicator match in call order, and one
that was given up on after a timeout can never be cancelled; every rank's next collective on that
communicator would then pair with the wrong call (a mismatch MPI does not detect).  Point-to-point
messages match by (source, tag), and each ``MPITransport`` (one per ``ExpertParallel``) gets its own tags
for data, agreed in its first :meth:`MPITransport.all_gather_object`: data a timed-out instance left
behind never reaches a later one, so a new instance built after a failure works.

* The order header (:mod:`moonep.guard`) uses one tag for every instance of the communicator, so that two
  layers called in different orders see each other's headers (and raise an order mismatch instead of
  timing out).  It travels with its instance's id: a header of an instance that is dead on the receiving
  rank (collected, or broken by a timeout) is a leftover of a call its sender gave up, and is dropped.
  Receives of a header exchange that timed out are cancelled, so they cannot take a peer's next header.
  What is left: a rank that keeps an instance alive but never makes the call its peers timed out in
  still holds their header of it; its next header exchange on another instance of the communicator
  then reports an order mismatch, and that instance fails on every rank (mismatch or timeout, never
  wrong data).  Dropping or closing the old instance (:meth:`MPITransport.close`), or making the call
  late, clears it.

* :meth:`MPITransport.all_gather_object` is robust to leftovers on its own: each call starts with a fresh
  random nonce per rank (a *hello* to every peer), a peer answers a hello with its pickled object (any
  size: the receiver probes the size first), and an answer counts only if it echoes this call's nonce.
  Leftover hellos and answers of a call that timed out are recognised and dropped.  A rank that arrives
  late at a call its peers gave up on simply pairs with their next ``all_gather_object`` call.
* After a timeout, an MPI error or an interrupt (any ``BaseException`` in a wait: Ctrl-C) the instance
  refuses every later call at once, naming why (its peers' messages of the failed call may still
  arrive); build a new ``ExpertParallel``.  So does a call that ``ExpertParallel`` left part way
  (:meth:`MPITransport.abandon_call`).
* Nothing here waits outside a call's own deadline, and nothing runs at garbage collection: no
  finalizer, no ``Wait``, no communicator ``Free`` (collective: it would block on a peer that skipped the
  failed call).  Requests given up on stay, with their buffers, in a module-level list (``_ABANDONED``),
  checked only with ``Test``: a late message lands in memory nothing else uses, whatever ended the wait.
  Every buffer is listed for that before its request is posted.  :meth:`MPITransport.close` is local.
  The communicator is the runtime's.
"""
from __future__ import annotations

import os
import pickle
import secrets
import struct
import time
import weakref

import numpy as np
import torch

from ..errors import MoonepError, expect
from ..work import join_host
from .base import Transport

# Requests given up on after a timeout, with their buffers: MPI may still write into (or read from) them.
_ABANDONED: list = []
# Next instance id per communicator (its Fortran handle); every rank takes the largest of the ranks'
# counters in an instance's first all_gather_object, so the ids agree even after a failed construction.
_NEXT_ID: dict = {}
_LIVE: dict = {}  # (communicator handle, instance id) -> weak reference to this rank's MPITransport
_TAG_SPACE: dict = {}  # communicator handle -> (all_gather_object tag, first instance tag, instance slots)
_KINDS = 2  # tags per instance: all_gather, all_to_all (the header tag is the communicator's: obj tag + 1)

_HELLO, _ANSWER = 1, 2
_HEAD = struct.Struct("<Bqqq")  # kind, echoed nonce, sender's nonce, sender's instance counter

# numpy has no bf16: half-width floats travel as int16 bit patterns (the bytes are what matter).
_WIRE_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.view(_WIRE_VIEW.get(t.dtype, t.dtype)).numpy()


_SPINS = [50]  # polls before the first sleep: 0 when this node's ranks outnumber its cores (set_polling)


def set_polling(local_ranks: int) -> None:
    """Poll without spinning when the ranks on this node outnumber the cores they may run on.

    Why: a spinning rank holds a core that a rank still computing needs; with 4 ranks on 2 cores, spinning
    waits made a dispatch and combine about twice as slow as sleeping ones."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    _SPINS[0] = 0 if local_ranks > cores else 50


def _nap(spins: int, waited: float) -> None:
    """Between polls: spin briefly for latency (not at all on shared cores), then sleep, longer the longer
    the wait (20 us, growing to 1 ms).

    A waiting rank must leave the cores to the ranks still working (they may share cores): short sleeps
    wake it thousands of times a second, each wake-up preempting a rank that has work to do."""
    if spins > _SPINS[0]:
        time.sleep(min(1e-3, max(2e-5, waited / 100)))


def _abandon(reqs, bufs) -> None:
    """Keep requests that may still complete (and what they read or write) alive; drop finished ones.

    Never ``Wait``/``Free`` them: a peer that skipped the call never matches them, and a dropped request
    would leave MPI writing into a buffer that Python has freed."""
    _ABANDONED.append((list(reqs), bufs))
    if len(_ABANDONED) > 256:
        keep = []
        for rs, b in _ABANDONED:
            try:
                done = all(r.Test() for r in rs)
            except Exception:  # noqa: BLE001 (a failed peer: keep it, harmlessly)
                done = False
            if not done:
                keep.append((rs, b))
        _ABANDONED[:] = keep


def _dead(comm, ident: int) -> bool:
    """Instance ``ident`` of ``comm`` is gone here (collected) or refuses calls (an earlier wait failed)."""
    ref = _LIVE.get((comm.py2f(), ident))
    t = ref() if ref is not None else None
    return t is None or t._broken is not None or t._closed


def _cancel(recvs, sends, bufs) -> None:
    """Give up an exchange: cancel its receives (on the shared header tag they would take a peer's next
    header), keep the sends and buffers alive."""
    for r in recvs:
        try:
            r.Cancel()
        except Exception:  # noqa: BLE001 (completed already, or a failed peer)
            pass
    _abandon(list(recvs) + list(sends), bufs)


def _post(comm, recv_bufs, send_bufs, peers, tag):
    """Post one receive from and one send to each of ``peers``; if posting fails part way, what was posted
    is abandoned (kept alive with its buffers) before the error propagates."""
    recvs, sends = [], []
    try:
        for b, p in zip(recv_bufs, peers):
            recvs.append(comm.Irecv(b, source=p, tag=tag))
        for b, p in zip(send_bufs, peers):
            sends.append(comm.Isend(b, dest=p, tag=tag))
    except BaseException:
        _cancel(recvs, sends, (recv_bufs, send_bufs))
        raise
    return recvs, sends


def _tag_space(comm, MPI):
    key = comm.py2f()
    space = _TAG_SPACE.get(key)
    if space is None:
        ub = comm.Get_attr(MPI.TAG_UB) or 32767  # MPI guarantees at least 32767
        base = (ub + 1) // 2  # the upper half: clear of the small tags applications tend to use
        space = _TAG_SPACE[key] = (base, base + 2, (ub - base - 2) // _KINDS)
    return space


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, comm, timeout: float = 60.0):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.peers = [p for p in range(self.world_size) if p != self.rank]
        self.timeout = float(timeout)
        # Errors (e.g. a peer's connection lost) become Python exceptions we can name, not an abort.
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._obj_tag, self._tag0, self._slots = _tag_space(comm, MPI)
        self._header_tag = self._obj_tag + 1
        self._id = self._tags = None  # instance id and its (all_gather, all_to_all) tags, from the first handshake
        self._broken = None  # why this instance refuses calls: an earlier wait timed out or failed
        self._closed = False

    def close(self) -> None:
        """This instance makes no more calls: its peers' headers that reach this rank later are dropped."""
        self._closed = True

    def timeout_s(self) -> float:
        return self.timeout

    def abandon_call(self, why: str) -> None:
        self._broken = self._broken or why  # also makes this instance's headers leftovers for the peers

    # -- failures ------------------------------------------------------------------------------------
    def _fail(self, what: str, why: str) -> MoonepError:
        self._broken = self._broken or f"{self.current_op}: {what} {why}"
        return MoonepError(f"rank {self.rank}: {self.current_op}: {what} {why}")

    def _usable(self) -> None:
        if self._broken is not None:
            raise MoonepError(f"rank {self.rank}: {self.current_op}: refused: an earlier collective of this "
                              f"instance failed or was left part way ({self._broken[:300]}); its peers' messages "
                              "may still arrive, so it cannot be used any more: build a new ExpertParallel")

    def _missing(self, what: str, missing: list[int]) -> MoonepError:
        who = "rank " + ", ".join(map(str, missing)) if len(missing) < 9 else f"{len(missing)} ranks"
        return self._fail(what, f"timed out: {who} did not join within the timeout of {self.timeout:g}s (dead, "
                          "stalled, or waiting in another collective)")

    def _left(self, what: str, exc: BaseException) -> BaseException:
        """What to raise when a wait ends by ``exc`` (the caller kept its requests and buffers): an MPI error
        becomes MoonepError; an interrupt (any other BaseException) is raised as it is.  Either way this
        instance refuses every later call, naming why."""
        if isinstance(exc, Exception):  # mpi4py.MPI.Exception: the library saw a failed peer
            return self._fail(what, f"failed: {exc}")
        self._broken = self._broken or f"{self.current_op}: {what} interrupted ({type(exc).__name__})"
        return exc

    def _poll(self, recvs, sends, what: str, bufs) -> None:
        """Poll point-to-point requests (``recvs[i]`` from ``self.peers[i]``) until all complete or the
        timeout passes; on expiry keep them alive (``_abandon``) and name the peers whose messages never
        came.  Other exceptions are the caller's to handle (it holds the requests and buffers)."""
        reqs = recvs + sends
        if not reqs:
            return
        MPI = self._MPI
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not MPI.Request.Testall(reqs):
            spins += 1
            _nap(spins, self.timeout - (deadline - time.monotonic()))
            if time.monotonic() > deadline:
                missing = [p for p, r in zip(self.peers, recvs) if not r.Test()]
                _abandon(reqs, bufs)
                if missing:
                    raise self._missing(what, missing)
                raise self._fail(what, f"did not complete within the timeout of {self.timeout:g}s (a send "
                                 "was not taken; a peer is stalled or called a different collective)")

    def _exchange(self, tag: int, what: str, recv_bufs, send_bufs, keep) -> None:
        """Post one receive from and one send to every peer on ``tag``, then wait.

        One message per peer per call, also when empty: both sides make the same calls in the same order,
        and MPI keeps messages of one (source, tag) in order, so the k-th message pairs with the k-th call.
        Whatever ends the wait early (a timeout, an MPI error, an interrupt), the requests and ``keep`` stay
        alive until MPI is done with them: a late message must land in memory nobody else uses.
        """
        recvs, sends = [], []
        try:
            recvs, sends = _post(self.comm, recv_bufs, send_bufs, self.peers, tag)
            self._poll(recvs, sends, what, keep)
        except MoonepError:
            raise
        except BaseException as exc:
            _abandon(recvs + sends, (keep, recv_bufs, send_bufs))
            raise self._left(what, exc) from (exc if isinstance(exc, Exception) else None)

    # -- the collectives -----------------------------------------------------------------------------
    def exchange_header(self, header):
        """Point-to-point swap with every peer, so a timeout knows exactly who did not send.

        The header travels with this instance's id.  A peer's header of an instance that is dead here
        (garbage-collected, or broken by a timeout) is a leftover of a call that peer gave up: it is dropped
        and the peer's next header awaited.  Headers of live instances are returned as they are, so two
        layers called in different orders see each other's (the guard reports the mismatch)."""
        self._usable()
        R = self.world_size
        n = len(header)
        ident = self._id if self._id is not None else self._ident()
        mine = np.array([*header, ident], dtype=np.int64)
        got = np.empty((R, n + 1), dtype=np.int64)
        got[self.rank] = mine
        if R == 1:
            return got[:, :n].tolist()
        comm, tag, MPI = self.comm, self._header_tag, self._MPI
        deadline = time.monotonic() + self.timeout
        spins = 0
        recvs, sends = [], []
        try:
            recvs, sends = _post(comm, [got[p] for p in self.peers], [mine] * len(self.peers), self.peers, tag)
            while True:
                if MPI.Request.Testall(recvs):
                    rows = got.tolist()
                    if all(row[n] == ident for row in rows):
                        break
                    stale = [i for i, p in enumerate(self.peers)
                             if rows[p][n] != ident and _dead(comm, rows[p][n])]
                    if not stale:
                        break
                    for i in stale:  # wait for that peer's header of this call instead
                        recvs[i] = comm.Irecv(got[self.peers[i]], source=self.peers[i], tag=tag)
                    continue
                spins += 1
                _nap(spins, self.timeout - (deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    missing = [p for p, r in zip(self.peers, recvs) if not r.Test()]
                    raise self._missing("header exchange", missing)
            self._poll([], sends, "header send", (got, mine))  # eager: done once the headers are in
        except BaseException as exc:
            # The receives share one tag with every instance's headers: cancelled, or they would take a
            # peer's next header.  The sends and both buffers are kept alive.
            _cancel(recvs, sends, (got, mine))
            if isinstance(exc, MoonepError):
                raise
            raise self._left("header exchange", exc) from (exc if isinstance(exc, Exception) else None)
        return [row[:n] for row in rows]

    def all_to_all(self, send, send_splits, recv_splits):
        expect(send.device.type == "cpu", "send", "a CPU tensor for the MPI transport", send.device)
        self._usable()
        send = send.contiguous()
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype)
        sbuf, rbuf = _np(send).reshape(-1), _np(recv).reshape(-1)
        s_off, r_off, s, r = [0], [0], 0, 0
        for a, b in zip(send_splits, recv_splits):
            s += int(a) * row
            r += int(b) * row
            s_off.append(s)
            r_off.append(r)
        me = self.rank
        rbuf[r_off[me]:r_off[me + 1]] = sbuf[s_off[me]:s_off[me + 1]]
        if self.world_size > 1:
            peers = self.peers
            self._exchange(self._instance_tags()[1], "all_to_all", [rbuf[r_off[p]:r_off[p + 1]] for p in peers],
                           [sbuf[s_off[p]:s_off[p + 1]] for p in peers], (sbuf, rbuf))
        return recv

    def all_to_all_sized(self, send, send_splits):
        """:meth:`all_to_all` without ``recv_splits``: each peer's message is matched by a probe
        (``MPI_Improbe``), which tells its size, then received into its slice of one buffer.  One round
        instead of two (the split exchange).  Messages on the instance's all-to-all tag pair in call order
        as in :meth:`_exchange`; a peer that never sends is named at the timeout (nothing was posted for it,
        so nothing is left writing into freed memory)."""
        expect(send.device.type == "cpu", "send", "a CPU tensor for the MPI transport", send.device)
        self._usable()
        send = send.contiguous()
        shape = send.shape[1:]
        sbuf = _np(send).reshape(-1)
        row = int(np.prod(shape, dtype=np.int64))
        s_off = np.concatenate([[0], np.cumsum(np.asarray(send_splits, dtype=np.int64) * row)]).tolist()
        me, R = self.rank, self.world_size
        if R == 1:
            return send.clone(), [send.shape[0]]
        if row == 0:  # rows of no bytes: a message's size cannot tell how many; exchange the splits
            return super().all_to_all_sized(send, send_splits)
        MPI, comm, tag = self._MPI, self.comm, self._instance_tags()[1]
        sends, msgs, sizes, recvs = [], {}, {}, []
        keep = [sbuf]

        def give_up():
            """Leaving early: matched messages not yet received are received into scratch (a matched message
            must be received, and nothing of this call may land later), then everything is kept alive."""
            for p in [p for p in msgs if msgs[p] is not None]:
                scratch = np.empty(sizes[p] * row, dtype=sbuf.dtype)
                keep.append(scratch)
                try:
                    recvs.append(msgs.pop(p).Irecv(scratch))
                except Exception:  # noqa: BLE001 (a failed peer: its buffer stays kept)
                    pass
            _abandon(recvs + sends, keep)

        try:
            for p in self.peers:
                sends.append(comm.Isend(sbuf[s_off[p]:s_off[p + 1]], dest=p, tag=tag))
            status = MPI.Status()
            deadline = time.monotonic() + self.timeout
            spins = 0
            while len(msgs) < len(self.peers):
                for p in self.peers:
                    if p not in msgs:
                        m = comm.Improbe(source=p, tag=tag, status=status)
                        if m is not None:
                            msgs[p] = m
                            sizes[p] = status.Get_count(MPI.BYTE) // sbuf.itemsize // max(row, 1)
                if len(msgs) == len(self.peers):
                    break
                spins += 1
                _nap(spins, self.timeout - (deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    missing = [p for p in self.peers if p not in msgs]
                    give_up()
                    raise self._missing("all_to_all", missing)
            recv_splits = [sizes[p] if p != me else int(send_splits[me]) for p in range(R)]
            recv = torch.empty((sum(recv_splits), *shape), dtype=send.dtype)
            rbuf = _np(recv).reshape(-1)
            keep.append(rbuf)
            r_off = np.concatenate([[0], np.cumsum(np.asarray(recv_splits, dtype=np.int64) * row)]).tolist()
            rbuf[r_off[me]:r_off[me + 1]] = sbuf[s_off[me]:s_off[me + 1]]
            for p in self.peers:
                recvs.append(msgs[p].Irecv(rbuf[r_off[p]:r_off[p + 1]]))
                msgs[p] = None  # received (posted): nothing left to drain
            self._poll(recvs, sends, "all_to_all", keep)
        except MoonepError:
            raise
        except BaseException as exc:
            give_up()
            raise self._left("all_to_all", exc) from (exc if isinstance(exc, Exception) else None)
        return recv, recv_splits

    def all_gather(self, t):
        self._usable()
        mine = t.to(torch.int64).contiguous().numpy().reshape(-1)
        got = np.empty((self.world_size, mine.size), dtype=np.int64)
        got[self.rank] = mine
        if self.world_size > 1:
            self._exchange(self._instance_tags()[0], "all_gather", [got[p] for p in self.peers],
                           [mine] * len(self.peers), (mine, got))
        return torch.from_numpy(got)

    def all_gather_object(self, obj):
        """Gather a picklable object of any size from every rank; returns ``R`` objects (ours is ``obj``).

        A hello/answer handshake with a fresh nonce per call (see the module docstring): robust to the
        leftovers of earlier calls that timed out, on any instance of the same communicator."""
        join_host()  # after the queued async_op=True calls (a no-op on the worker that runs them)
        self._usable()
        if self.world_size == 1:
            self._agree_tags(self._counter(), [])
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        got = self._handshake(data)
        self._agree_tags(self._counter(), [c for _, c in got.values()])
        return [obj if p == self.rank else pickle.loads(got[p][0]) for p in range(self.world_size)]

    # -- the handshake -------------------------------------------------------------------------------
    def _counter(self) -> int:
        return _NEXT_ID.get(self.comm.py2f(), 0)

    def _agree_tags(self, mine: int, theirs: list[int]) -> None:
        """The first handshake of an instance fixes its id (the largest counter of the ranks) and tags."""
        if self._tags is not None:
            return
        ident = max([mine, *theirs])
        key = self.comm.py2f()
        _NEXT_ID[key] = ident + 1
        _LIVE[(key, ident)] = weakref.ref(self, lambda _, k=(key, ident): _LIVE.pop(k, None))
        first = self._tag0 + (ident % self._slots) * _KINDS
        self._id, self._tags = ident, (first, first + 1)

    def _instance_tags(self):
        if self._tags is None:  # an instance whose first call is not all_gather_object: agree on tags now
            self.all_gather_object(None)
        return self._tags

    def _ident(self) -> int:
        self._instance_tags()
        return self._id

    def _handshake(self, data: bytes) -> dict:
        """``{peer: (pickled object, instance counter)}`` from every peer, or MoonepError on expiry."""
        MPI, comm, tag, peers = self._MPI, self.comm, self._obj_tag, self.peers
        nonce = secrets.randbits(62) + 1
        counter = self._counter()
        hello = np.frombuffer(_HEAD.pack(_HELLO, 0, nonce, counter), dtype=np.uint8)
        answer_tail = np.frombuffer(data, dtype=np.uint8)
        sends = []  # (peer, echoed nonce, request, buffer)
        got: dict = {}  # peer -> (data, counter) of an answer to this call's nonce
        current: dict = {}  # peer -> its nonce in this call (from its valid answer)
        answered: dict = {}  # peer -> the last nonce we answered
        inbox: dict = {}  # peer -> (request, buffer) of a message being received
        posted = [hello]  # every buffer handed to MPI, listed before its request is posted (kept on a failure)
        status = MPI.Status()

        def answer(p: int, echo: int) -> None:
            buf = np.concatenate([np.frombuffer(_HEAD.pack(_ANSWER, echo, nonce, counter), dtype=np.uint8),
                                  answer_tail])
            posted.append(buf)
            sends.append((p, echo, comm.Isend(buf, dest=p, tag=tag), buf))
            answered[p] = echo

        def handle(p: int, msg: np.ndarray) -> None:
            kind, echo, their, their_counter = _HEAD.unpack_from(msg)
            if kind == _HELLO:
                if answered.get(p) != their:
                    answer(p, their)
            elif kind == _ANSWER and echo == nonce and p not in got:
                got[p] = (msg[_HEAD.size:].tobytes(), their_counter)
                current[p] = their
                if answered.get(p) != their:
                    answer(p, their)
            # anything else: a leftover of an earlier call that timed out (dropped)

        def done() -> bool:
            return len(got) == len(peers) and all(answered.get(p) == current[p] for p in peers)

        deadline = time.monotonic() + self.timeout
        spins = 0
        try:
            for p in peers:
                sends.append((p, None, comm.Isend(hello, dest=p, tag=tag), hello))
            while True:
                progressed = False
                for p in peers:
                    # Read p's messages in order until its answer to this call: what p sends after it
                    # (the hello of its next call) is left for our next call.
                    while p not in got:
                        if p in inbox:
                            req, buf = inbox[p]
                            if not req.Test():
                                break
                            del inbox[p]
                            handle(p, buf)
                            progressed = True
                            if p in got:  # its answer: leave what follows for the next call
                                break
                        m = comm.Improbe(source=p, tag=tag, status=status)
                        if m is None:
                            break
                        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)  # the size first
                        posted.append(buf)
                        inbox[p] = (m.Irecv(buf), buf)
                if done():
                    # Our answers to the peers' current nonces must arrive before we leave (a large one
                    # moves only while both sides call MPI); hellos and stale answers may stay in flight.
                    final = [r for p, echo, r, _ in sends if echo is not None and echo == current.get(p)]
                    if MPI.Request.Testall(final):
                        break
                if not progressed:
                    spins += 1
                    _nap(spins, self.timeout - (deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    missing = [p for p in peers if p not in got]
                    if missing:
                        raise self._missing("all_gather_object", missing)
                    late = sorted({p for p, echo, r, _ in sends if echo is not None and echo == current.get(p)})
                    raise self._fail("all_gather_object", f"timed out: rank {', '.join(map(str, late))} did not "
                                     f"take its message within the timeout of {self.timeout:g}s")
        except BaseException as exc:  # a timeout, an MPI error or an interrupt: keep what MPI may still use
            _abandon([r for _, _, r, _ in sends] + [r for r, _ in inbox.values()], posted)
            if isinstance(exc, MoonepError):
                raise
            raise self._left("all_gather_object", exc) from (exc if isinstance(exc, Exception) else None)
        # What is still in flight (answers to leftover nonces, which nobody may ever take): kept alive,
        # not waited for.
        rest = [(r, b) for _, _, r, b in sends if not r.Test()] + list(inbox.values())
        if rest:
            _abandon([r for r, _ in rest], [b for _, b in rest])
        return got
