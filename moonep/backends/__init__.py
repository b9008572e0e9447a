"""Backends: the ways rows move between ranks, each behind the interface of :mod:`.base`.

    host.py     MPI or torch.distributed with host-known splits (CPU, or GPUs without peer access)
    nvlink.py   device-initiated kernels writing into the peers' memory (GPUs of one node)
    local.py    one process without a process group

:func:`make_backend` picks one when an :class:`moonep.ExpertParallel` is built.
"""
from __future__ import annotations

import torch

from ..config import Tuning
from .base import Backend
from .host import HostBackend
from .local import LocalBackend
from .nvlink import NVLinkBackend, default_timeout, nvlink_available

__all__ = ["Backend", "HostBackend", "LocalBackend", "NVLinkBackend", "choose_backend", "make_backend"]


def choose_backend(transport: str, rt, host, device, dtype) -> str:
    """``"nvlink"``, or the name of the host transport ``host`` (``"mpi"``, ``"torch"``, ``"local"``).

    ``"auto"`` takes nvlink on CUDA for 16/32-bit rows (its kernels move no float64) when every rank can
    reach its peers; finding that out is collective (every rank's verdict), so every rank must call this.
    ``transport="nvlink"`` refuses, on every rank, when some rank cannot."""
    if transport == "nvlink" or (transport == "auto" and device.type == "cuda" and rt.group is not None
                                 and dtype in (torch.float32, torch.bfloat16, torch.float16)):
        ok, why = nvlink_available(rt) if device.type == "cuda" else (False, "not a CUDA device")
        verdicts = host.all_gather_object((ok, why))
        bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
        if transport == "nvlink" and bad:
            raise ValueError(f"transport: expected every rank to reach its peers over NVLink/P2P, got "
                             f"rank {bad[0][0]}: {bad[0][1]}")
        if not bad:
            return "nvlink"
    return host.name


def make_backend(ep, kind: str, *, timeout, zero_copy, tuning: Tuning) -> Backend:
    """The backend ``kind`` (from :func:`choose_backend`) of ``ep``, whose runtime, transport and sizes are
    set.  Collective for nvlink (symmetric buffers)."""
    if kind == "nvlink":
        return NVLinkBackend(ep, timeout=default_timeout(ep.rt) if timeout is None else timeout,
                             zero_copy=zero_copy, tuning=tuning)
    if kind == "local":
        return LocalBackend(ep, ep.transport)
    return HostBackend(ep, ep.transport)
