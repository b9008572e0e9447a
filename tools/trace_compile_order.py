"""Each rank's collective sequence through a compiled ``LatentMoE`` step, for diagnosing compiled hangs.

    mpirun -n 2 python3 tools/trace_compile_order.py 0,17      # CUDA ranks; token counts of ranks 0, 1

Prints, per rank, every call header it posts on the NVLink backend's order board (op name and number) and
when each forward and backward returns; ``TORCH_LOGS=output_code`` adds the generated code (grep it for
``torch.ops.moonep``).  A rank stuck for 45 s dumps its Python stacks to ``/tmp/trace_compile_rank<r>.txt``.
Step 1 swaps the counts of ranks 0 and 1, so that each rank recompiles once.
"""
import faulthandler
import importlib.util
import sys
import time
from pathlib import Path

import torch

import moonep
from moonep.transport import order_board

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    sizes = [int(v) for v in sys.argv[1].split(",")]
    rt = moonep.init(device="cuda")
    faulthandler.dump_traceback_later(45, repeat=True, file=open(f"/tmp/trace_compile_rank{rt.rank}.txt", "w"))

    def log(*what):
        print(f"[rank {rt.rank}] {time.strftime('%H:%M:%S')}", *what, file=sys.stderr, flush=True)

    posted = order_board.OrderBoard.exchange

    def exchange(board, header, what="a collective"):
        log(f"board gen {board.gen + 1}: {what}")
        return posted(board, header, what)

    order_board.OrderBoard.exchange = exchange
    spec = importlib.util.spec_from_file_location("cases_compile", REPO / "tests/mp/cases_compile.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)  # the layer of the compile test cases
    layer = cases._layer(rt, 2 * rt.world_size, 20)
    cases._layer_step(rt, layer, 4, 99)  # eager: builds the ExpertParallel
    compiled = torch.compile(layer, fullgraph=True)
    for step in range(2):
        s = sizes[rt.rank if step == 0 else (1 - rt.rank) % len(sizes)]
        x = torch.randn(s, cases.D, device="cuda", requires_grad=True)
        log(f"step {step} s={s}: forward")
        y = compiled(x)
        torch.cuda.synchronize()
        log("forward returned")
        y.square().sum().backward()
        torch.cuda.synchronize()
        log("backward returned")
    faulthandler.cancel_dump_traceback_later()
    rt.shutdown()


if __name__ == "__main__":
    main()
