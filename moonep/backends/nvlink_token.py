"""The NVLink step as one int64 tensor: what ``moonep::dispatch`` returns as the step token (``moonep.ops``).

A compiled graph (CUDA graph trees above all) lets a device tensor outlive an op only as an output of the op
that made it and an input of the ops that read it.  So the step's device state leaves ``moonep::dispatch`` in
one allocation, the token (a custom op's outputs may not alias each other), and the later ops read views of it:

    words [0, L)    int32 lists: row_first [cap], rec [cap, K], src [cap], tokfirst [R*S] (the layout of
                    ``NVLinkBackend._step_lists``; tokfirst unused when the dispatch ran the two-kernel
                    path); L is that size in words, 256-byte aligned
    then            replica_experts [R, epn], replica_source [R] (the plan's, int64)
    then            dst_rank [s, K], dst_row [s, K] (int64)

The host part (step number, generation, ``s``, whether tokfirst is set) stays in ``moonep.op_state``'s registry
as a :class:`Kept`, which holds no tensor.  Eager calls need none of this: their token is ``[1]`` and the
registry keeps the :class:`moonep.handles.Step` itself.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..errors import expect
from ..handles import Step


class Kept(NamedTuple):
    step: Step         # without tensors (routing: an NVLinkStep without tensors; plan None)
    tokfirst: bool     # whether the step has a tokfirst list


class StepToken:
    """Packs and unpacks the steps of one NVLink instance (sizes: ``cap`` rows, top-``K``, ``R`` ranks, ``S``
    max tokens, ``epn`` experts per rank)."""

    def __init__(self, cap: int, K: int, R: int, S: int, epn: int):
        self.cap, self.K, self.R, self.S, self.epn = cap, K, R, S, epn
        self.lists_words = -(-4 * (cap * (K + 2) + R * S) // 256) * 32
        # the words before the 2*s*K destination words
        self.state_words = self.lists_words + R * epn + R

    def pack(self, h: Step, device) -> torch.Tensor:
        """int64 ``[state_words + 2*s*K]``: a copy of the device state of step ``h``, laid out as above."""
        st, plan = h.routing, h.plan
        cap, K, R, S, epn, L = self.cap, self.K, self.R, self.S, self.epn, self.lists_words
        s = st.num_tokens
        token = torch.empty(self.state_words + 2 * s * K, dtype=torch.int64, device=device)
        lists = token[:L].view(torch.int32)
        lists[:cap].copy_(st.row_first)
        lists[cap:cap * (K + 1)].copy_(st.rec.reshape(-1))
        lists[cap * (K + 1):cap * (K + 2)].copy_(st.src)
        if st.tokfirst is not None:
            lists[cap * (K + 2):cap * (K + 2) + R * S].copy_(st.tokfirst.reshape(-1))
        token[L:L + R * epn].copy_(plan.replica_experts.reshape(-1))
        token[L + R * epn:self.state_words].copy_(plan.replica_source.reshape(-1))
        o = self.state_words
        token[o:o + s * K].copy_(st.dst_rank.reshape(-1))
        token[o + s * K:o + 2 * s * K].copy_(st.dst_row.reshape(-1))
        return token

    @staticmethod
    def host_part(h: Step) -> Kept:
        """What the registry keeps of step ``h``: no tensor."""
        st = copy.copy(h.routing)  # keeps the step number and instance (plain attributes of StepState)
        has_tokfirst = st.tokfirst is not None
        st.dst_rank = st.dst_row = st.row_first = st.rec = st.src = st.tokfirst = st.w32 = st.cu = None
        st.issued = None  # a compiled graph's weights are its own tensors: not checked against dispatch's
        return Kept(Step(None, None, None, st), has_tokfirst)

    def unpack(self, kept: Kept, token: torch.Tensor) -> Step:
        """The step, its tensors views of ``token`` (what :meth:`pack` wrote); its ``plan`` has the replica
        tables only (all that combine, prefetch and reduce read on NVLink)."""
        st = copy.copy(kept.step.routing)
        cap, K, R, S, epn, L = self.cap, self.K, self.R, self.S, self.epn, self.lists_words
        s = st.num_tokens
        words = self.state_words + 2 * s * K
        expect(token.dtype == torch.int64 and token.dim() == 1 and token.numel() == words, "step token",
               f"int64 [{words}]", f"{token.dtype} {list(token.shape)}")
        token = token.contiguous()
        lists = token[:L].view(torch.int32)
        st.row_first, st.rec = lists[:cap], lists[cap:cap * (K + 1)].view(cap, K)
        st.src = lists[cap * (K + 1):cap * (K + 2)]
        st.tokfirst = lists[cap * (K + 2):cap * (K + 2) + R * S] if kept.tokfirst else None
        o = self.state_words
        st.dst_rank, st.dst_row = token[o:o + s * K].view(s, K), token[o + s * K:o + 2 * s * K].view(s, K)
        plan = SimpleNamespace(replica_experts=token[L:L + R * epn].view(R, epn),
                               replica_source=token[L + R * epn:self.state_words])
        return Step(None, None, plan, st)
