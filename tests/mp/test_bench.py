"""``moonep-bench`` end to end: 2 CPU ranks under mpiexec, a tiny sweep, the JSON and the output checked;
``--help`` and a missing optional package under mpiexec, shown once and before anything runs."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness.mp import REPO_ROOT, mpiexec_cmd, run_bounded

CODES = ("d_logGB", "eff_dp", "xSym_d", "megD_us", "xMeg_d", "rcv_max")  # the old tables' column codes


def _run(cmd, timeout, expect_rc=0, pythonpath=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*pythonpath, str(REPO_ROOT), env.get("PYTHONPATH")]))
    rc, out, err, timed_out = run_bounded(cmd, timeout=timeout, env=env)  # hydra and ranks: one session
    if timed_out:
        pytest.fail(f"timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    assert rc == expect_rc, f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


@pytest.fixture(scope="module")
def run_tiny(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench") / "results"  # not there yet: --out creates it
    stdout, stderr = _run(mpiexec_cmd(2) + [sys.executable, "-m", "moonep.bench", "--preset", "tiny",
                                            "--device", "cpu", "--out", str(out_dir), "--plot"], timeout=120)
    files = sorted(out_dir.glob("moonep_bench_cpu_np2_*.json"))
    assert len(files) == 1, sorted(out_dir.iterdir())
    return json.loads(files[0].read_text()), files[0], stdout, stderr


def test_provenance_and_header(run_tiny):
    doc, out, stdout, stderr = run_tiny
    launcher, n, ranks, python = doc["command"].split()[:4]
    assert launcher in ("mpiexec", "mpirun") and (n, ranks) == ("-n", "2")
    assert f"-m moonep.bench --preset tiny --device cpu --out {out.parent} --plot" in doc["command"]
    # a source tarball has no .git: the commit is then "unknown" unless a .git_commit file names it
    has_git = (REPO_ROOT / ".git").exists() or (REPO_ROOT / ".git_commit").exists()
    assert doc["git_commit"] and (doc["git_commit"] != "unknown" or not has_git)
    assert {"host", "cpu", "cores", "torch"} <= set(doc["machine"])
    assert doc["ranks"] == 2 and doc["device"] == "cpu" and doc["dtype"] == "bf16"
    assert doc["transport"] in ("mpi", "torch") and doc["megatron_backend"] == "all_to_all_single on gloo"
    assert "not a bound" in doc["reference_kind"] and "ceiling_kind" not in doc  # CPU: no hardware ceiling
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_output_once_in_words(run_tiny):
    """Rank 0 alone prints the progress and the tables; headings are words, each table has a legend."""
    _, out, stdout, stderr = run_tiny
    assert "2/2" in stderr and stderr.count("moonep-bench: 100%") >= 1  # tqdm
    assert stdout.count("# moonep-bench: 2 ranks on cpu") == 1
    assert stdout.count("# moonep: time per call") == 1 and stdout.count("# -- 32 tokens per rank") == 7
    assert stdout.count("#  legend:") == 7 and "most rows received (rows)" in stdout
    assert "# MoE layer training step" in stdout and "# MoE layer inference step" in stdout
    assert stdout.count(f"# wrote {out}") == 1
    assert not [c for c in CODES if c in stdout]


def test_points(run_tiny):
    doc = run_tiny[0]
    pts = doc["points"]
    assert [p["maxvio_target"] for p in pts] == [0, 2]
    for p in pts:
        s, K, R = p["tokens"], p["topk"], doc["ranks"]
        assert (p["tokens"], p["hidden"], p["experts"], p["topk"]) == (32, 64, 16, 4)
        assert p["maxvio"] >= 0
        assert [m["slack"] for m in p["moonep"]] == [0.0, 0.05]
        for m in p["moonep"]:
            for k in ("dispatch_us", "combine_us", "prefetch_us", "dispatch_prefetch_us"):
                assert 0 < m[k] < 60e6, (k, m[k])
            for k in ("dispatch_logical_GBps", "dispatch_wire_GBps", "vs_megatron_dispatch", "vs_megatron_combine"):
                assert m[k] > 0, (k, m[k])
            assert "dispatch_efficiency" not in m  # efficiencies are against a hardware ceiling only
            assert m["check_rel_err"] < 2e-2
            assert sum(m["recv_rows_per_rank"]) == R * s * K
            assert m["replicas"] == sum(m["replicas_per_rank"]) and m["replica_weight_bytes"] >= 0
            assert 0 < m["remote_pairs"] <= m["token_copies"] == R * s * K
        exact = p["moonep"][0]
        assert exact["recv_rows_max"] == exact["recv_rows_min"] == s * K  # the guarantee at slack 0
        assert p["moonep"][1]["recv_rows_max"] <= 1.05 * s * K + 1
        g = p["megatron"]
        assert g["dispatch_us"] > 0 and g["combine_us"] > 0 and g["check_rel_err"] < 2e-2
        assert sum(g["recv_rows_per_rank"]) == R * s * K
        assert p["reference"]["dispatch_us"] > 0 and p["reference"]["combine_us"] > 0 and "ceiling" not in p
        lay = p["layer"]
        for step in ("train", "inference"):
            assert lay[f"{step}_moonep_us"] > 0 and lay[f"{step}_megatron_us"] > 0
            assert 0 < lay[f"{step}_speedup_p25"] <= lay[f"{step}_speedup"] <= lay[f"{step}_speedup_p75"]
            assert len(lay[f"{step}_moonep_per_rank_us"]) == R
        assert lay["train_check_rel_err"] < 2e-2  # bf16: the paths' outputs and gradients agree
        assert len(lay["megatron_expert_us"]) == R
        dc = p["dispatch_combine"]
        assert dc["moonep_us"] > 0 and dc["megatron_us"] > 0 and dc["speedup_p25"] <= dc["speedup"] <= dc["speedup_p75"]
        assert lay["megatron_rows_per_rank"] == g["recv_rows_per_rank"]
        assert "symm_mem" not in p  # CPU run: the NVSHMEM baseline is GPU only
    # the skewed routing is skewed, the uniform one is not
    assert pts[1]["maxvio"] > pts[0]["maxvio"] and pts[1]["maxvio"] > 1.0


def test_report_reprints_tables(run_tiny):
    out, first = run_tiny[1], run_tiny[2]
    stdout, _ = _run([sys.executable, "-m", "moonep.bench", "--report", str(out)], timeout=60)
    assert stdout.strip() == first[:first.index("# wrote")].strip()


def test_help_once_under_mpiexec():
    stdout, stderr = _run(mpiexec_cmd(2) + [sys.executable, "-m", "moonep.bench", "--help"], timeout=60)
    assert stdout.count("usage:") == 1 and "--out DIR" in stdout and not stderr.strip()
    assert "issue" not in stdout.lower()


def test_missing_matplotlib_reported_before_measuring(tmp_path):
    """A matplotlib that fails to import (first on PYTHONPATH): --plot is refused at once, by rank 0 only,
    naming the extra, and nothing is measured or written."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: matplotlib is not installed')\n")
    out_dir = tmp_path / "results"
    stdout, stderr = _run(mpiexec_cmd(2) + [sys.executable, "-m", "moonep.bench", "--preset", "tiny", "--device",
                                            "cpu", "--out", str(out_dir), "--plot"], timeout=60, expect_rc=1,
                          pythonpath=[str(fake.parent)])
    assert stderr.count("nothing was measured") == 1 and stderr.count("pip install 'moonep[bench]'") == 1
    assert "matplotlib (for --plot)" in stderr and "point" not in stderr and not stdout.strip()
    assert not out_dir.exists()


def test_preset_and_flags_parse():
    from moonep.bench.__main__ import parse

    a = parse(["--preset", "h200"])
    assert (a.tokens, a.hidden, a.ek, a.ffn, a.device) == ([4096], [7168], [(256, 8)], 2048, "cuda")
    assert a.maxvio == [0, 0.25, 0.5, 1, 2, 4] and a.slack == [0.0, 0.02, 0.05]
    a = parse(["--preset", "h200", "--maxvio", "1", "--ek", "384x8", "896x16"])
    assert a.maxvio == [1.0] and a.ek == [(384, 8), (896, 16)] and a.tokens == [4096]
    a = parse([])
    assert a.device == "auto" and a.tokens == [128]


def test_bench_compile_cpu_json(tmp_path):
    """benchmarks/bench_compile.py on one CPU process, tiny: eager and inductor (the layer's math fused, the
    default, and kept at eager's bits) timed, the JSON's provenance, library, the dtype it ran in and the
    ratios to eager."""
    out = tmp_path / "compile.json"
    _run([sys.executable, "benchmarks/bench_compile.py", "--device", "cpu", "--tokens", "16", "--d-model", "32",
          "--d-latent", "16", "--experts", "4", "--topk", "2", "--d-expert", "16", "--iters", "2", "--warmup", "1",
          "--out", str(out)], timeout=300)
    got = json.loads(out.read_text())
    assert {"command", "commit", "machine"} <= got.keys() and "bench_compile.py" in got["command"]
    assert got["config"]["dtype"] == "fp32" and got["config"]["transport"] == "local", got["config"]
    ms, ratio = got["ms_per_step"], got["speedup_vs_eager"]
    assert set(ratio) == {"default", "default+bitwise"} and ms["eager"] > 0 and got["library"] == "the tree"
    for mode in ratio:
        assert ms[mode] > 0 and abs(ratio[mode] - ms["eager"] / ms[mode]) < 1e-12, mode


def test_bench_overlap_cpu_json(tmp_path):
    """benchmarks/bench_overlap.py on one CPU process, tiny, with its diagnosis switches: the four cases timed
    (and their host time), the overlapped step bitwise the serial one, the profiler's tables and traces."""
    out, prof = tmp_path / "overlap.json", tmp_path / "prof" / "p"
    _run([sys.executable, "benchmarks/bench_overlap.py", "--device", "cpu", "--tokens", "32", "--hidden", "16",
          "--experts", "4", "--topk", "2", "--ffn", "16", "--iters", "2", "--warmup", "1", "--sm-carveout", "8",
          "--profile", str(prof), "--out", str(out)], timeout=300)
    got = json.loads(out.read_text())
    assert {"command", "git_commit", "machine"} <= got.keys() and "bench_overlap.py" in got["command"]
    cases = {"serial", "overlapped", "comm", "compute"}
    assert set(got["median_ms"]) == cases == set(got["host_median_ms"]), got["median_ms"]
    assert all(v > 0 for v in got["median_ms"].values()) and got["overlapped_bitwise_equal_to_serial"] is True
    assert got["config"]["sm_carveout"] == 8 and "gemm_beside_dispatch" not in got  # (CUDA only)
    for case in ("serial", "overlapped"):
        assert "Self CPU" in (prof.parent / f"p_{case}.txt").read_text()
        assert json.loads((prof.parent / f"p_{case}.json").read_text())["traceEvents"]


def test_bench_op_overhead_json(tmp_path):
    """benchmarks/bench_op_overhead.py, tiny: a plain call, an autograd.Function and three kinds of op timed with
    and without grad mode, the differences the JSON reports, its provenance."""
    out = tmp_path / "ovh.json"
    _run([sys.executable, "benchmarks/bench_op_overhead.py", "--calls", "50", "--reps", "2", "--out", str(out)],
         timeout=120)
    got = json.loads(out.read_text())
    assert {"command", "commit", "machine"} <= got.keys() and "bench_op_overhead.py" in got["command"]
    us = got["us_per_call"]
    ops = ("custom_op", "library_register_autograd", "library_moonep_autograd")
    assert set(us) == {"plain", "autograd_function", *ops}
    assert all(v > 0 for r in us.values() for v in r.values())
    for name in ops:
        for k in ("grad_us", "no_grad_us"):
            assert abs(got["minus_function_us"][name][k] - (us[name][k] - us["autograd_function"][k])) < 0.01
