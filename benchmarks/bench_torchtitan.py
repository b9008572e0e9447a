"""torchtitan's own trainer with its DeepSeek-V3 debug model: moonep against the all-to-all dispatcher.

    python benchmarks/bench_torchtitan.py --out benchmarks/results/cpu_torchtitan_train_np2.json

Four runs of ``torchtitan.train`` at 2 ranks, each from the same seed and data: the all-to-all dispatcher
(EP = 2), moonep (EP = 2, ``--override.imports moonep.integrations.torchtitan.moonep_experts``, checkpoints
at steps 25 and 50 through torchtitan's checkpointer), moonep resumed from the step-25 checkpoint, and a
control: torchtitan's own dispatcher at EP = 1, how far two exact implementations drift apart in bf16.  Writes
the loss curves (JSON, and a PNG beside it) and how the resumed run's losses compare.  The ranks run
:mod:`tests.harness.torchtitan_train` (``torchtitan.train.main`` with torch-2.13 and CPU stand-ins).

Data: no data set can be downloaded here, so the run makes its own: text from a fixed random bigram language
(``--docs`` documents) and a BPE tokenizer trained on it (the ``tokenizers`` package), in the layout
torchtitan's ``c4_test`` loader reads (``--dataloader.dataset_path``, ``--hf_assets_path``).  Needs
torchtitan with its data stack (``pip install -e ".[torchtitan]"``); ``--device cuda`` on a machine with
``--nproc`` GPUs (NCCL takes one GPU per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MOONEP = "moonep.integrations.torchtitan.moonep_experts"
CPU_ATTENTION = "tests.harness.torchtitan_train.cpu_attention_flexattention"


def make_data(where: Path, docs: int, vocab: int, seed: int = 0) -> tuple[Path, Path]:
    """``docs`` documents of a random bigram language over 400 made-up words, and a BPE tokenizer of
    ``vocab`` tokens trained on them.  Returns (data folder, tokenizer folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    nexts = {w: rng.sample(words, 6) for w in words}  # each word is followed by one of 6 others
    data, tok = where / "data", where / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    texts = []
    for _ in range(docs):
        w = rng.choice(words)
        out = [w]
        for _ in range(rng.randint(100, 300)):
            w = rng.choice(nexts[w]) if rng.random() < 0.9 else rng.choice(words)
            out.append(w)
        texts.append(" ".join(out) + ".")
    with open(data / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<bos>", "<eos>"]))
    bpe.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return data, tok


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.eE+-]+)")


def losses_of(log: str) -> dict:
    """``{step: loss}`` from torchtitan's training log (its metrics line of every step)."""
    out = {}
    for line in _ANSI.sub("", log).splitlines():
        m = _STEP.search(line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def train(args, name: str, dump: Path, overrides: list, ep: int | None = None) -> tuple[dict, float]:
    """One ``torchtitan.train`` run at ``args.nproc`` ranks; returns its losses and seconds."""
    imports = ([CPU_ATTENTION] if args.device == "cpu" else []) + overrides
    # rank 0's output on the console (the ranks' lines would interleave), every rank's in the run's folder
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--local-ranks-filter", "0", "--log-dir", str(dump / "ranks"), "--tee", "3",
           "-m", "tests.harness.torchtitan_train",
           "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
           "--hf_assets_path", str(args.tok), "--dataloader.dataset", "c4_test",
           "--dataloader.dataset_path", str(args.data), "--dump_folder", str(dump),
           "--training.steps", str(args.steps), "--training.local_batch_size", str(args.batch),
           "--training.seq_len", str(args.seq), "--parallelism.expert_parallel_degree", str(ep or args.nproc),
           "--parallelism.spmd_backend", "partial_dtensor", "--metrics.log_freq", "1", "--training.disable_cuda_graphs",
           "--checkpoint.enable", "--checkpoint.interval", str(args.ckpt_every),
           "--debug.seed", "7", *(["--override.imports", ",".join(imports)] if imports else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    secs = time.perf_counter() - t0
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"{name}: torchtitan.train exited with {proc.returncode}; log: {dump / 'train.log'}\n"
                 + (proc.stdout + proc.stderr)[-4000:])
    return losses_of(proc.stdout + proc.stderr), secs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/cpu_torchtitan_train_np2.json")
    ap.add_argument("--work", default="/tmp/moonep_torchtitan_run")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ckpt-every", dest="ckpt_every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    args.data, args.tok = make_data(work, args.docs, vocab=2000)
    runs = {}
    runs["all_to_all"] = train(args, "all-to-all", work / "a2a", [])
    runs["moonep"] = train(args, "moonep", work / "moonep", [MOONEP])
    # resume: a fresh run folder holding only moonep's step-25 checkpoint; torchtitan loads the latest one
    resume = work / "moonep_resumed"
    (resume / "checkpoint").mkdir(parents=True)
    shutil.copytree(work / "moonep" / "checkpoint" / f"step-{args.ckpt_every}",
                    resume / "checkpoint" / f"step-{args.ckpt_every}")
    runs["moonep_resumed"] = train(args, "moonep resumed", resume, [MOONEP])
    # the control: torchtitan against itself, EP = 1 (its local dispatcher, every expert on every rank) against
    # EP = 2: how far two exact implementations drift apart under bf16 and AdamW
    runs["all_to_all_ep1"] = train(args, "all-to-all EP=1", work / "a2a_ep1", [], ep=1)
    from moonep.bench.provenance import git_commit, machine

    curves = {k: {str(s): v for s, v in sorted(r[0].items())} for k, r in runs.items()}
    a, m, r = (runs[k][0] for k in ("all_to_all", "moonep", "moonep_resumed"))
    both = sorted(set(a) & set(m))
    after = [s for s in sorted(r) if s > args.ckpt_every]
    summary = dict(
        steps_logged={k: len(v[0]) for k, v in runs.items()},
        max_rel_diff_moonep_vs_all_to_all=max(abs(m[s] - a[s]) / abs(a[s]) for s in both),
        max_rel_diff_moonep_vs_all_to_all_first_5_steps=max(abs(m[s] - a[s]) / abs(a[s]) for s in both[:5]),
        max_rel_diff_all_to_all_ep1_vs_ep2=max(abs(runs["all_to_all_ep1"][0][s] - a[s]) / abs(a[s]) for s in both),
        resumed_from_step=args.ckpt_every, resumed_steps=after,
        max_abs_diff_resumed_vs_uninterrupted=max(abs(r[s] - m[s]) for s in after) if after else None,
        seconds={k: round(v[1], 1) for k, v in runs.items()})
    record = dict(what="torchtitan.train, DeepSeek-V3 debug model, EP=%d, moonep vs all-to-all" % args.nproc,
                  command=" ".join([sys.executable, *sys.argv]), commit=git_commit(), machine=machine(),
                  settings=dict(device=args.device, nproc=args.nproc, steps=args.steps, local_batch_size=args.batch,
                                seq_len=args.seq, spmd_backend="partial_dtensor", data="random bigram language, "
                                f"{args.docs} documents, BPE 2000", attention="causal SDPA" if args.device == "cpu"
                                else "the config's"),
                  summary=summary, losses=curves)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    plot(curves, out.with_suffix(".png"), args.ckpt_every)
    print(json.dumps(summary, indent=1))


def plot(curves: dict, path: Path, resumed_at: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    style = {"all_to_all": dict(color="tab:gray", lw=3, alpha=0.5, label="torchtitan all-to-all"),
             "moonep": dict(color="tab:blue", lw=1.2, label="moonep"),
             "moonep_resumed": dict(color="tab:red", ls="none", marker=".",
                                    label=f"moonep resumed at step {resumed_at}"),
             "all_to_all_ep1": dict(color="tab:green", lw=0.8, ls="--", label="torchtitan EP = 1 (control)")}
    for k, c in curves.items():
        ax.plot([int(s) for s in c], list(c.values()), **style[k])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("torchtitan.train, DeepSeek-V3 debug model, 2 CPU ranks, EP = 2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
