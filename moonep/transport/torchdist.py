"""torch.distributed transport: ``all_to_all_single`` on gloo (CPU) or NCCL (CUDA).

Timeouts come from the process group (``moonep.init(timeout=...)``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Transport

# Renamed in torch 2.13; keep working on older releases (the GPU image has 2.11).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistTransport(Transport):
    name = "torch"

    def __init__(self, group, cpu_group=None):
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def all_to_all(self, send, send_splits, recv_splits):
        if send.is_cuda and self.backend == "gloo":  # gloo moves host memory: stage CUDA tensors through it
            return self.all_to_all(send.cpu(), send_splits, recv_splits).to(send.device)
        send = send.contiguous()
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
        if send.dtype == torch.bool:  # gloo has no bool all-to-all
            return self.all_to_all(send.view(torch.uint8), send_splits, recv_splits).view(torch.bool)
        dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=self.group)
        return recv

    def all_gather(self, t):
        if t.is_cuda and self.backend == "gloo":
            return self.all_gather(t.cpu()).to(t.device)
        t = t.to(torch.int64).contiguous()
        out = torch.empty(self.world_size * t.numel(), dtype=torch.int64, device=t.device)
        _all_gather_single(out, t.reshape(-1), group=self.group)
        return out.view(self.world_size, -1)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out
