"""The NVLink kernels' binary interface on the Python side, declared once: the context block (``struct Ctx``
in ``csrc/common.cuh``) and the constants shared with the kernels.

Why a module of its own, not part of ``nvlink.py`` or ``cuda_runtime.py``: it is the one place both sides of
the contract can be compared. ``moonep/backends/nvlink.py`` builds the context words from :data:`CTX_FIELDS`
through :func:`ctx_words` (no bare indices), and ``tests/unit/test_cuda_abi.py`` parses ``csrc/common.cuh``
and checks every field, index, count and constant here against it. It imports nothing (no torch, no CuPy),
so that check runs anywhere.
"""
from __future__ import annotations

MAXR = 64          # MAXR: most ranks (peer pointers per array in the context)
CTR_WORDS = 16     # CTR_WORDS: u64 counters per engine (entry / data / tag epochs, per-chunk arrivals)
MAX_CHUNKS = 8     # MAX_CHUNKS: source-token chunks of the fused kernels, one signal array each

# Row dtype codes (DT_*).
DT_F32, DT_BF16, DT_F16 = 0, 1, 2
# Error codes: ERR_TIMEOUT is the fatal code (a peer did not signal; bits 8.. carry its rank); the others are
# input-error bits (bits 8.. carry the first rank that saw one).
ERR_TIMEOUT = 1
ERR_BAD_IDX, ERR_DUP_IDX, ERR_NONFINITE, ERR_TOTAL = 1, 2, 4, 8
ERR_NONFINITE_X = 16   # a non-finite token, found by the fp8 dispatch's quantiser

# struct Ctx, in order: (field, int64 words).  Every field is 8 bytes: i64 scalars, pointers, arrays of them.
CTX_FIELDS = (
    ("rank", 1), ("R", 1), ("S", 1), ("K", 1), ("H", 1), ("cap", 1), ("E2", 1), ("timeout_ns", 1),
    ("ctr", 1),    # u64 [CTR_WORDS] counters, this rank's memory
    ("derr", 1),   # int: this rank's fatal word
    ("herr", 1),   # int [2], host-mapped: [0] fatal, [1] input error
    # byte offsets of the symmetric areas, the same in every rank's allocation
    ("off_esig", 1), ("off_dsig", 1), ("off_gather", 1), ("off_recv", 1), ("off_w", 1), ("off_tag", 1),
    ("off_meta", 1), ("off_msrc", 1), ("off_acc", 1), ("off_gwacc", 1), ("off_csig", 1), ("off_flist", 1),
    ("pad", 9),
    ("base", MAXR),    # each rank's main allocation, as mapped here
    ("gbase", MAXR),   # each rank's gradient receive buffer
    ("pbase", MAXR),   # each rank's replica weight pool
)


def _index():
    at, w = {}, 0
    for name, n in CTX_FIELDS:
        at[name] = w
        w += n
    return at, w


CTX_INDEX, CTX_WORDS = _index()   # field -> first word; 224 words
# The symmetric areas with an offset in the context (off_<name>), in field order.
CTX_OFFSETS = tuple(name[4:] for name, _ in CTX_FIELDS if name.startswith("off_"))


def ctx_words(**fields) -> list:
    """The context block as CTX_WORDS int64 values (Python ints).

    Every scalar field of CTX_FIELDS must be given (``off_<name>`` for the offsets); the arrays (base, gbase,
    pbase) are sequences of at most MAXR pointers, zero-filled after them, and may be None (all zero);
    ``pad`` is always zero."""
    words = [0] * CTX_WORDS
    for name, n in CTX_FIELDS:
        if name == "pad":
            continue
        if n == 1:
            if name not in fields:
                raise TypeError(f"ctx_words: missing field {name!r}")
            words[CTX_INDEX[name]] = int(fields.pop(name))
            continue
        vals = list(fields.pop(name, None) or ())
        if len(vals) > n:
            raise ValueError(f"ctx_words: {name} takes at most {n} entries, got {len(vals)}")
        words[CTX_INDEX[name]:CTX_INDEX[name] + len(vals)] = [int(v) for v in vals]
    if fields:
        raise TypeError(f"ctx_words: unknown fields {sorted(fields)}")
    return words
