"""One process without a process group (``R = 1``): the host backend's row operations over the identity
transport.  The slot layout, the static ``[cap, H]`` shapes and every addition are those of the other
backends, so a model gives the same bits in a plain process as on one rank of a job."""
from __future__ import annotations

from .host import HostBackend


class LocalBackend(HostBackend):
    """Chosen by ``ExpertParallel(group=None)`` in a process that no launcher started and that has no
    ``torch.distributed`` group (``transport`` ``"auto"`` or ``"local"``)."""
