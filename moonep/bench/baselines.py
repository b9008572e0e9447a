"""The paths moonep is measured against, in the same run and on the same routing.

* :class:`MegatronA2A`: Megatron-LM's all-to-all dispatcher in plain PyTorch ops. Dispatch sorts the
  token copies by expert (the permute), exchanges the per-expert counts, copies them to the host (the
  device-to-host sync that gives ``all_to_all_single`` its host-known splits), sends **every copy**, then
  regroups the received rows by local expert. Combine is the reverse: un-regroup, send back, weight and
  scatter-add into the tokens.
* :class:`SymmMemA2A`: ``torch.ops.symm_mem.all_to_all_vdev_2d`` (dispatch) and ``_2d_offset`` (combine),
  splits on device, on the NVSHMEM backend. The op takes at most 16 local experts: with more, experts
  are bucketed into ``ne <= 16`` contiguous groups per rank and rows arrive grouped by bucket (a
  grouped GEMM would still need a per-expert permute inside each bucket, which is not timed).
* :class:`PeerStoreCeiling`: on GPU a copy kernel storing 16-byte words straight into the peers' memory
  (CUDA IPC through moonep's symmetric buffers), moving exactly the bytes moonep puts on the wire: the
  hardware ceiling. On CPU: one transport all-to-all of the same rows (moonep's overhead floor).
"""
from __future__ import annotations

import numpy as np
import torch


class MegatronA2A:
    """Permute, all-to-all with host-known splits, regroup; the reverse for combine.

    ``a2a(send, send_splits, recv_splits)`` is the collective (``all_to_all_single`` on NCCL or gloo, or
    moonep's MPI transport on CPU ranks so that both paths use the same wire).
    """

    def __init__(self, a2a, R: int, E: int, K: int, backend: str):
        self.a2a, self.R, self.E, self.K, self.epn = a2a, R, E, K, E // R
        self.backend = backend

    def dispatch(self, x, idx):
        """-> (rows grouped by local expert ``[n_recv, H]``, context for combine and the GEMM)."""
        R, E, K, epn = self.R, self.E, self.K, self.epn
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)             # copies sorted by expert, hence by rank
        tok = torch.div(order, K, rounding_mode="floor")
        send = x.index_select(0, tok)                         # the permute: one row per copy
        counts = torch.bincount(flat, minlength=E)            # [R * epn]: copies for each remote expert
        recv_counts = self.a2a(counts.view(R, epn), [1] * R, [1] * R)  # [R src, epn]
        host = torch.cat([counts, recv_counts.reshape(-1)]).cpu()     # the device-to-host sync
        send_splits = host[:E].view(R, epn).sum(1).tolist()
        rc = host[E:].view(R, epn)
        recv_splits = rc.sum(1).tolist()
        n_recv = sum(recv_splits)
        recv = self.a2a(send, send_splits, recv_splits)       # grouped by source, then local expert
        local_e = torch.arange(epn, device=x.device).repeat(R)
        local_e = torch.repeat_interleave(local_e, recv_counts.reshape(-1), output_size=n_recv)
        perm = torch.argsort(local_e, stable=True)             # regroup by local expert
        tokens = recv.index_select(0, perm)
        per_expert = rc.sum(0)
        cu = torch.nn.functional.pad(per_expert.cumsum(0), (1, 0)).to(torch.int32)
        ctx = dict(order=order, tok=tok, perm=perm, send_splits=send_splits, recv_splits=recv_splits,
                   cu_seqlens=cu.to(x.device, non_blocking=True), n_recv=n_recv, num_tokens=x.shape[0])
        return tokens, ctx

    def combine(self, out, w, ctx):
        """``out [n_recv, H]`` in the dispatch's row order -> ``[s, H]`` weighted sums."""
        back = torch.empty_like(out)
        back.index_copy_(0, ctx["perm"], out)                  # undo the regroup
        ret = self.a2a(back, ctx["recv_splits"], ctx["send_splits"])
        wsorted = w.reshape(-1).index_select(0, ctx["order"]).to(out.dtype)
        y = torch.zeros((ctx["num_tokens"], out.shape[1]), dtype=out.dtype, device=out.device)
        return y.index_add_(0, ctx["tok"], ret * wsorted[:, None])


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


class SymmMemA2A:
    """``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset`` on NVSHMEM symmetric memory.

    Construction is collective and raises (on this rank) when the ops, the backend or the allocation are
    unavailable; callers agree across ranks before using it (see :func:`moonep.bench.suite`).
    """

    MAX_LOCAL = 16

    def __init__(self, group, R: int, E: int, K: int, S: int, H: int, dtype, device):
        import os

        import torch.distributed._symmetric_memory as symm_mem

        ops = torch.ops.symm_mem
        for name in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"):
            if not hasattr(ops, name):
                raise RuntimeError(f"torch.ops.symm_mem.{name} does not exist in torch {torch.__version__}")
        self.R, self.E, self.K, self.epn = R, E, K, E // R
        self.ne = _largest_divisor_at_most(self.epn, self.MAX_LOCAL)
        self.bucket = self.epn // self.ne
        es = torch.empty((), dtype=dtype).element_size()
        need = (2 * S * K + R * S * K) * H * es + (1 << 26)
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(int(need * 1.25) + (1 << 30)))
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        symm_mem.set_backend("NVSHMEM")
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            try:
                symm_mem.enable_symm_mem_for_group(self.group_name)
            except Exception:  # deprecated/no-op in newer releases
                pass
        n = R * self.ne
        self.inp = symm_mem.empty(S * K, H, dtype=dtype, device=device)
        self.out = symm_mem.empty(R * S * K, H, dtype=dtype, device=device)   # worst case: every copy here
        self.comb = symm_mem.empty(S * K, H, dtype=dtype, device=device)
        self.in_splits = symm_mem.empty(n, dtype=torch.int64, device=device)
        self.out_so = symm_mem.empty(2, n, dtype=torch.int64, device=device)
        self.comb_so = symm_mem.empty(2, n, dtype=torch.int64, device=device)
        for t in (self.inp, self.out, self.comb, self.in_splits, self.out_so, self.comb_so):
            symm_mem.rendezvous(t, self.group_name)
        self.note = (f"ne={self.ne} local buckets of {self.bucket} experts" if self.bucket > 1 else
                     f"ne={self.ne} local experts")

    def dispatch(self, x, idx):
        K = self.K
        flat = idx.reshape(-1)
        g = torch.div(flat, self.bucket, rounding_mode="floor")   # global bucket = rank * ne + local bucket
        order = torch.argsort(flat, stable=True)                   # sorted by expert, hence by bucket
        tok = torch.div(order, K, rounding_mode="floor")
        n = flat.numel()
        torch.index_select(x, 0, tok, out=self.inp[:n])
        self.in_splits.copy_(torch.bincount(g, minlength=self.R * self.ne))
        torch.ops.symm_mem.all_to_all_vdev_2d(self.inp, self.out, self.in_splits, self.out_so, self.group_name)
        return self.out, dict(order=order, tok=tok, n=n, num_tokens=x.shape[0])

    def received_rows(self) -> int:
        return int(self.out_so[0].sum())

    def combine(self, w, ctx):
        """The expert output is expected in place in ``self.out`` (what dispatch returned)."""
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(self.out, self.comb, self.out_so, self.comb_so,
                                                     self.group_name)
        n = ctx["n"]
        rows = self.comb[:n]
        wsorted = w.reshape(-1).index_select(0, ctx["order"]).to(rows.dtype)
        y = torch.zeros((ctx["num_tokens"], rows.shape[1]), dtype=rows.dtype, device=rows.device)
        return y.index_add_(0, ctx["tok"], rows * wsorted[:, None])


_PEER_STORE_SRC = r"""
extern "C" __global__ void moonep_bench_peer_store(const unsigned long long* dst, const long long* nvec,
                                                   unsigned long long src_ptr) {
  const int4* src = reinterpret_cast<const int4*>(src_ptr);
  int4* d = reinterpret_cast<int4*>(dst[blockIdx.y]);
  const long long n = nvec[blockIdx.y];
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) d[i] = src[i];
}
"""
_KERNELS: dict = {}


class PeerStoreCeiling:
    """Store ``nbytes[p]`` into each peer ``p``'s memory at once, 16-byte words, ``blocks`` CTAs per peer.

    Collective construction (a :class:`moonep.transport.ipc.SymmetricBuffer` of ``R * slot_bytes``); rank
    ``r`` writes into ``[r * slot, r * slot + nbytes[p])`` of peer ``p``, so senders never overlap.
    """

    def __init__(self, rt, slot_bytes: int, blocks: int = 32, threads: int = 512):
        from moonep.transport.ipc import SymmetricBuffer

        self.rt, self.R, self.rank = rt, rt.world_size, rt.rank
        self.device = rt.device
        self.slot = (int(slot_bytes) + 255) // 256 * 256
        self.blocks, self.threads = blocks, threads
        gather = self._gather
        self.buf = SymmetricBuffer(self.R * self.slot, self.device, self.rank, self.R, gather)
        self.src = torch.randn(self.slot // 4, device=self.device)  # 16-byte aligned source
        dev = self.device.index
        if dev not in _KERNELS:
            import cupy

            with cupy.cuda.Device(dev):
                _KERNELS[dev] = cupy.RawKernel(_PEER_STORE_SRC, "moonep_bench_peer_store", backend="nvrtc")
        self.kernel = _KERNELS[dev]
        self.peers = [p for p in range(self.R) if p != self.rank]
        self.dst = torch.tensor([self.buf.peer_ptrs[p] + self.rank * self.slot for p in self.peers] or [0],
                                dtype=torch.int64, device=self.device)
        self.nvec = torch.zeros(max(len(self.peers), 1), dtype=torch.int64, device=self.device)

    def _gather(self, obj):
        import torch.distributed as dist

        out = [None] * self.R
        dist.all_gather_object(out, obj, group=self.rt.cpu_group)
        return out

    def set_bytes(self, nbytes_to_peer: list[int]) -> None:
        """Bytes for every rank ``p`` (this rank's entry is ignored); rounded down to 16-byte words."""
        words = [min(int(nbytes_to_peer[p]), self.slot) // 16 for p in self.peers] or [0]
        self.nvec.copy_(torch.tensor(words, dtype=torch.int64))
        torch.cuda.synchronize(self.device)

    def __call__(self):
        import cupy

        from moonep import cuda_runtime

        if not self.peers:
            return None
        with cupy.cuda.Device(self.device.index), cuda_runtime.stream(self.device.index):
            self.kernel((self.blocks, len(self.peers)), (self.threads,),
                        (np.uint64(self.dst.data_ptr()), np.uint64(self.nvec.data_ptr()),
                         np.uint64(self.src.data_ptr())))
        return None

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.buf.close(barrier=lambda: self._gather(None))
