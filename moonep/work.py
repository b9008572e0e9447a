"""Collectives in flight: what ``async_op=True`` returns, and where such a call runs meanwhile.

    work = ep.dispatch(x_b, idx_b, w_b, async_op=True)   # B's rows move ...
    out_a = experts(h_a)                                  # ... while A's experts compute
    h_b = work.wait()

One :class:`Overlap` per :class:`moonep.ExpertParallel` runs its asynchronous calls, in the order they were made:

- **CUDA**: the call's kernels are queued on the device's communication stream (one per device, see
  :class:`Chain`), after the caller's stream (or after ``previous_event``).  ``wait()`` makes the current
  stream wait for them: stream order, no host sync.  Tensors that cross streams are recorded on the stream
  that reads them (``record_stream``), so the caching allocator never hands their memory out while a kernel
  on the other stream still uses it.
- **Host backends** (CPU tensors, MPI or gloo): the call runs on the process's one worker thread, which
  waits in the transport's polls with the GIL released.  ``wait()`` blocks until the call finished and raises
  what it raised.  Every collective made from another thread (a synchronous call, a backward pass) first
  waits for the queued ones, so every rank runs its collectives, of every instance, in the order it made
  them (the call-order check compares them across instances too).

The order guard: a :class:`Work` dropped without ``wait()`` is a bug in the caller (its result was never
waited for).  The instance's first collective made after that point is then refused on every rank, naming
the call, and the one after it works.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import op_state


def tensors_in(obj) -> list:
    """The tensors in ``obj`` (a tensor, or nested tuples/lists of them and other values)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    return []


class Work:
    """A collective call in flight (``async_op=True``).  ``wait()`` returns the call's result.

    Attributes:
        op: the call (``"dispatch"``, ``"combine"``, ...).
        event: CUDA: a ``torch.cuda.Event`` recorded after the call's kernels on the communication stream
            (for ``previous_event=`` of a later call, or a stream of the caller's own); ``None`` on the host.
    """

    def __init__(self, overlap: "Overlap", op: str, index: int, *, result=None, event=None,
                 future: Future | None = None):
        self.op, self.event = op, event
        self._result, self._future = result, future
        self._device = overlap.device
        self._finalizer = weakref.finalize(self, overlap.dropped, index, op)

    def wait(self):
        """The call's result, once the current stream (CUDA) or this thread (host) may read it.

        CUDA: the current stream waits for the call's event (no host sync); the result's tensors are recorded on
        the current stream.  Host: blocks until the worker thread finished the call; raises what it raised.
        Waiting again returns the same result."""
        self._finalizer.detach()
        if self._future is not None:
            self._result, self._future = self._future.result(), None
        elif self.event is not None:  # (every time: a second wait may come from another stream)
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self.event)
            for t in tensors_in(self._result):
                if t.is_cuda:
                    t.record_stream(stream)
        return self._result

    def unguarded(self) -> None:
        """Not subject to the order guard: its result is read only through something that waits for it."""
        self._finalizer.detach()

    def is_completed(self) -> bool:
        """Whether the call finished (CUDA: its kernels ran; host: the worker thread returned).  Never blocks."""
        if self._future is not None:
            return self._future.done()
        return self.event is None or self.event.query()


def _copy_into(out: torch.Tensor, src: torch.Tensor) -> None:
    """``out.copy_(src)``, and a step token's registration moved along; a broadcast (stride-0) output, which
    the fake implementation already made equal (fp8's zero gradient anchor), is left alone."""
    if out.numel() and 0 not in out.stride():
        out.copy_(src)
    op_state.move_step(src, out)


class CompiledWork:
    """What ``async_op=True`` returns under ``torch.compile``: the call is the op ``moonep::<op>_async``, which
    returns its outputs and a work tensor at once, and :meth:`wait` is the op ``moonep::wait_work``, which
    writes them in place (so everything that reads them comes after it in the graph, as with torch's
    functional collectives and ``wait_tensor``).

    Attributes:
        op: the call; event: ``None`` (a compiled graph orders its streams itself)."""

    event = None

    def __init__(self, op: str, outputs: list, work: torch.Tensor, op_id: int, finish, keep=()):
        self.op, self._outputs, self._work, self._op_id, self._finish = op, outputs, work, op_id, finish
        self._keep = [t for t in keep if isinstance(t, torch.Tensor)]  # the call's inputs: alive until the wait
        self._result, self._waited = None, False

    def wait(self):
        """The call's result (``finish`` of the waited outputs); waiting again returns it again."""
        if not self._waited:
            torch.ops.moonep.wait_work.default(self._outputs, self._work, self._op_id, self._keep)
            self._result, self._waited = None if self._finish is None else self._finish(self._outputs), True
        return self._result

    def is_completed(self) -> bool:
        """Whether :meth:`wait` was called (a compiled graph cannot ask its streams without a host sync)."""
        return self._waited

    def unguarded(self) -> None:
        """As :meth:`Work.unguarded`: nothing to do here (see :meth:`Overlap.start_compiled`)."""


class _Worker:
    """The process's thread for asynchronous host calls (one FIFO for every instance: see the module)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, run) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moonep-overlap")
            fut = self._pool.submit(run)
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def join(self) -> None:
        if not self._pending or on_worker():
            return
        with self._lock:
            pending = list(self._pending)
        wait_futures(pending)  # (an interrupt here leaves them pending: the next join waits again)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]


_WORKER = _Worker()


def join_host() -> None:
    """Wait for the queued asynchronous host calls (no-op on the worker thread): what every host collective of
    moonep runs first, so that it never runs beside one of them on the same channel."""
    _WORKER.join()


class Chain:
    """One CUDA device's order of collectives, shared by every instance on it.

    The NVLink kernels of every instance spin on every SM they are given and wait for their peers' matching
    launch, so two collectives, even of two instances, must never run at once on two streams: a rank's GPU
    could then start one while a peer's starts the other.  Once a second stream carries collectives (the
    replica pool's side stream, the communication stream of ``async_op=True``), every collective notes the
    stream it ran on (:meth:`after`), and the next one, when it runs on another stream, first waits for that
    stream (:meth:`join`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.multi = False    # collectives run on more than one stream: note every one's stream
        self.stream = None    # the communication stream of async_op=True calls
        self._last = None     # (Stream, raw handle) of the last collective, not yet waited for by the next one
        self._event = None    # the event :meth:`join` records on it
        self._streams: dict = {}   # raw handle -> its torch.cuda.Stream (see current)

    def current(self):
        """The device's current stream, and its raw handle.  The Stream objects are kept by handle: building one
        (``torch.cuda.current_stream``) costs more host time than the rest of a collective's bookkeeping."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) >= 64:  # (streams a caller made and dropped)
                self._streams.clear()
            s = self._streams[raw] = torch.cuda.current_stream(self.device)
        return s, raw

    def after(self, stream=None) -> None:
        """A collective was queued on ``stream`` (default: the current one): the next one waits for it."""
        self.multi = True
        if torch._C._cuda_isCurrentStreamCapturing():
            # inside a CUDA graph capture the captured streams' own order holds (one stream, or a fork and
            # join); nothing recorded here may be waited for outside the capture
            self._last = None
            return
        self._last = self.current() if stream is None else (stream, stream.cuda_stream)

    def join(self) -> None:
        """The current stream waits for the last collective, when that ran on another stream.  The event is
        recorded only then, on that stream: it also covers what was queued there since, which is at most more
        than needed (the side streams carry collectives only, and a collective on the caller's stream is
        mostly followed by another on the same stream: no event at all).  Not while capturing a CUDA graph: an
        event from before the capture may not be waited for inside it, and ``torch.cuda.graph`` synchronizes
        the device before it captures."""
        last, self._last = self._last, None
        if last is None or torch._C._cuda_isCurrentStreamCapturing():
            return
        stream, raw = self.current()
        if raw != last[1]:  # (on the same stream, the stream's own order holds)
            if self._event is None:
                self._event = torch.cuda.Event()
            # (one event, recorded again each time: a wait already queued keeps the record it followed)
            self._event.record(last[0])
            stream.wait_event(self._event)

    def comm_stream(self):
        if self.stream is None:
            self.stream = side_stream(self.device)
        return self.stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream for collectives beside the caller's compute, at high priority (DeepEP's convention): the
    block scheduler then starts a collective's blocks as soon as SMs free up, instead of after every pending
    block of the GEMMs queued before it, which would run the two one after the other."""
    return torch.cuda.Stream(device, priority=-1)


_CHAINS: dict = {}


def chain(device: torch.device) -> Chain:
    """The :class:`Chain` of ``device`` (one per process and device: ``cuda`` means the current one)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    c = _CHAINS.get(device)
    if c is None:
        c = _CHAINS[device] = Chain(device)
    return c


_RUNNING = threading.local()  # on the worker: (the Overlap, the index) of the async call it runs


def on_worker() -> bool:
    """Whether this thread is the worker (its calls run in queue order already)."""
    return threading.current_thread().name.startswith("moonep-overlap")


class Overlap:
    """Where one ExpertParallel's asynchronous calls run (see the module's docstring).  ``device``: the
    instance's device; CUDA gets a communication stream, anything else a worker thread."""

    def __init__(self, device: torch.device):
        self.device = device
        self.chain = chain(device) if device.type == "cuda" else None
        self._dropped: list[tuple[int, str]] = []
        self._count = 0  # async calls made so far: a call's index
        self._compiled: dict = {}  # compiled calls not waited for: work tensor's address -> (its ref, Work, outputs)
        self._lock = threading.RLock()  # (a finalizer may run inside a locked section of the same thread)

    # -- the order guard -------------------------------------------------------------------------------
    def dropped(self, index: int, op: str) -> None:
        """The :class:`Work` of async call ``index`` (``op``) was garbage-collected without ``wait()``: the first
        call made after this point (index ``self._count`` or later, or the next synchronous one) is refused."""
        with self._lock:
            self._dropped.append((self._count, op))

    def take_dropped(self) -> str | None:
        """Why the collective now running must be refused (a Work was dropped unwaited before this call was
        made), once; else ``None``."""
        if self._compiled:
            self._sweep_compiled()
        if not self._dropped:  # (the common case, without the lock)
            return None
        # the worker runs async call `index` of its instance; any other call is made now, after every queued one
        running = getattr(_RUNNING, "call", None)
        index = running[1] if running is not None and running[0] is self else self._count
        with self._lock:
            ops = [op for at, op in self._dropped if at <= index]
            if not ops:
                return None
            self._dropped = [(at, op) for at, op in self._dropped if at > index]
        return (f"async_op: every Work must be waited for (work.wait()) before its result is used, but the Work of "
                f"{len(ops)} earlier call(s) ({', '.join(ops)}) was dropped without wait(); this call is refused "
                "on every rank and the next one runs")

    # -- running calls ---------------------------------------------------------------------------------
    def _next_index(self) -> int:
        """The index of an async call being made (the order guard's count of calls)."""
        with self._lock:
            index, self._count = self._count, self._count + 1
        return index

    def submit(self, op: str, fn, inputs=(), previous_event=None) -> Work:
        """Run ``fn()`` (one collective call of the instance) asynchronously; returns its :class:`Work`.
        ``inputs``: the caller's tensors that the call reads (CUDA: recorded on the communication stream);
        ``previous_event``: a ``torch.cuda.Event`` or ``None`` (``ExpertParallel._launch`` refused anything else
        on every rank)."""
        index = self._next_index()
        if self.device.type == "cuda":
            return self._submit_cuda(op, index, fn, inputs, previous_event)
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # saved-tensor hooks (activation checkpointing) pair what is saved by the order of the saves: a call
            # beside the caller's own work would interleave them, so it runs here, in order (every rank alike)
            join_host()
            fut: Future = Future()
            try:
                fut.set_result(fn())
            except Exception as exc:  # raised by wait(), as from the worker (an interrupt propagates at once)
                fut.set_exception(exc)
            return Work(self, op, index, future=fut)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def run():  # the caller's autograd modes are thread-local: carried into the worker
            _RUNNING.call = (self, index)
            try:
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    return fn()
            finally:
                _RUNNING.call = None

        return Work(self, op, index, future=_WORKER.submit(run))

    # -- asynchronous calls inside a compiled graph (moonep.ops' *_async ops, see CompiledWork) ----------------
    def start_compiled(self, op: str, fn, empty_outputs, inputs, mutated: list, guarded: bool = True) -> tuple:
        """The body of an ``moonep::<op>_async`` op: run ``fn()`` (the synchronous op's body) as :meth:`submit`
        does; returns ``(outputs, work)``.  ``outputs`` are the op's outputs at once: CUDA, ``fn()``'s own,
        filled in stream order on the communication stream; host, ``empty_outputs()`` (the fake
        implementation's shapes), which the worker fills when ``fn()`` returned.  ``mutated``: the tensors the
        op writes in place.  ``work``: a fresh int64 ``[1]`` tensor naming the call for ``moonep::wait_work``.
        ``guarded``: a work tensor that died before its wait drops the call (the order guard,
        :meth:`take_dropped`)."""
        self._sweep_compiled()  # (before a new work tensor may take a dead one's address)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a CUDA graph being captured (mode="reduce-overhead"): in order on the captured stream, no overlap
            # (a fork onto the communication stream inside a capture has not run on a GPU yet)
            index = self._next_index()
            outs = fn()
            w = Work(self, op, index, result=outs)
        elif self.device.type == "cuda":
            w = self.submit(op, fn, inputs)
            outs = w._result
        else:
            outs = empty_outputs()

            def fill():  # on the worker: the result lands in the tensors the graph already holds
                result = fn()
                for o, r in zip(tensors_in(outs), tensors_in(result)):
                    _copy_into(o, r)
                return outs

            w = self.submit(op, fill, inputs)
        w.unguarded()  # guarded by its work tensor instead
        work = torch.empty(1, dtype=torch.int64, device=self.device)
        with self._lock:
            self._compiled[work.data_ptr()] = (StorageWeakRef(work.untyped_storage()), w,
                                               tensors_in(outs) + tensors_in(mutated), guarded)
        return outs, work

    def wait_compiled(self, outs: list, work: torch.Tensor) -> None:
        """The body of ``moonep::wait_work``: wait as :meth:`Work.wait` does for the call of ``work``; an
        output that the compiler copied before this point (``outs[i]`` another tensor than the call's own)
        gets the call's values."""
        with self._lock:
            entry = self._compiled.pop(work.data_ptr(), None)
        if entry is None:
            raise ValueError("work: expected the work tensor of an async call of this ExpertParallel not waited "
                             "for yet, got another tensor (or one already waited for)")
        _, w, own, _ = entry
        w.wait()
        for o, r in zip(outs, own):
            if o.data_ptr() != r.data_ptr():
                _copy_into(o, r)

    def _sweep_compiled(self) -> None:
        """Compiled calls whose work tensor died unwaited count as dropped Works (guarded ones).  Only on the
        caller's thread, whose calls are made in program order on every rank (not on the worker, which may run
        behind it)."""
        if on_worker() or not self._compiled:
            return
        with self._lock:
            for k in [k for k, (ref, *_) in self._compiled.items() if ref.expired()]:
                _, w, _, guarded = self._compiled.pop(k)
                if guarded:
                    self._dropped.append((self._count, w.op))

    def _submit_cuda(self, op: str, index: int, fn, inputs, previous_event) -> Work:
        caller = torch.cuda.current_stream(self.device)
        comm = self.chain.comm_stream()
        if previous_event is not None:
            comm.wait_event(previous_event)
        else:  # the caller's work so far (what made the inputs) comes first
            comm.wait_stream(caller)
        with torch.cuda.stream(comm):
            result = fn()
        event = torch.cuda.Event()
        event.record(comm)
        for t in tensors_in(inputs):  # the allocator must not reuse them before the communication stream read them
            if t.is_cuda:
                t.record_stream(comm)
        return Work(self, op, index, result=result, event=event)
