"""The training recipes of docs/training.md, each an examples/training/*.py script, run on every rank."""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from tests.harness.mp import SkipCase

SkipCase = getattr(sys.modules.get("__main__"), "SkipCase", SkipCase)  # noqa: F811  (mprun's own class)
ROOT = Path(__file__).resolve().parents[2]


def _example(name: str):
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SkipCase("transformers is not installed (pip install -e .[hf])")
    path = ROOT / "examples" / "training" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _finite(losses):
    assert losses and all(v == v and abs(v) < 1e3 for v in losses), losses


def case_example_ddp(rt):
    ddp = _example("ddp")
    _finite(ddp.main(["--steps", "2", "--micro", "2"]))
    _finite(ddp.main(["--steps", "2", "--model", "latent", "--autocast"]))


def case_example_fsdp2(rt):
    _finite(_example("fsdp2").main(["--steps", "2"]))


def case_example_checkpoint(rt):
    ck = _example("checkpoint")
    box = [tempfile.mkdtemp(prefix="moonep-example-") if rt.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=rt.cpu_group)
    whole = ck.main(["--steps", "4"])
    ck.main(["--steps", "2", "--save", f"{box[0]}/dcp"])
    resumed = ck.main(["--steps", "2", "--resume", f"{box[0]}/dcp", "--export", f"{box[0]}/hf"])
    assert max(abs(a - b) for a, b in zip(resumed, whole[2:])) <= 1e-5 * abs(whole[2]), (resumed, whole)
    assert (Path(box[0]) / "hf" / "config.json").exists()


def case_example_generate(rt):
    out = _example("generate").main([])
    assert len(out) == 5 + 3 + rt.rank, out
