"""``moonep-bench``'s command line without running a sweep: the recorded command, where results go, rank
detection, rank-0-only help, the optional-package check, and the tables of documents old and new."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moonep.bench import cli, tables

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_program_names_how_it_was_started():
    assert cli.program("/venv/bin/moonep-bench") == ["moonep-bench"]
    exe = Path(sys.executable).name
    assert cli.program("/repo/moonep/bench/__main__.py") == [exe, "-m", "moonep.bench"]


def test_result_path(tmp_path):
    assert cli.result_path(str(tmp_path / "x.json"), "cpu", 2) == tmp_path / "x.json"
    p = cli.result_path(str(tmp_path), "cuda", 4, now=0)
    assert p.parent == tmp_path and p.name.startswith("moonep_bench_cuda_np4_") and p.suffix == ".json"
    assert cli.result_path(None, "cpu", 1).parent == Path(".")  # the current directory, nothing below it


def test_launch_rank_and_prefix():
    assert cli.launch_rank({}) == 0
    assert cli.launch_rank({"PMI_RANK": "1", "PMI_SIZE": "2"}) == 1
    assert cli.launch_rank({"OMPI_COMM_WORLD_RANK": "3"}) == 3
    assert cli.launch_rank({"RANK": "2", "WORLD_SIZE": "4"}) == 2
    assert cli.launcher_prefix({"PMI_SIZE": "2"}) == ("mpiexec -n 2", 2)
    assert cli.launcher_prefix({}) == ("", 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_help_and_usage_errors_on_rank_0_only(rank, capsys):
    for argv, code in ((["--help"], 0), (["--tokens", "many"], 2)):
        with pytest.raises(SystemExit) as exc:
            cli.parse_on_rank(argv, rank)
        assert exc.value.code == code  # every rank exits as argparse says
        out, err = capsys.readouterr()
        assert bool(out + err) == (rank == 0)


def test_presets_and_flags_parse():
    a = cli.parse(["--preset", "tiny", "--maxvio", "1"])
    assert a.tokens == [32] and a.maxvio == [1.0] and a.out is None and a.report is None


def test_missing_packages_named_with_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert cli.missing_packages(plot=False, device="cpu") == []
    lines = cli.missing_packages(plot=True, device="cpu")
    assert len(lines) == 1 and "matplotlib (for --plot)" in lines[0] and "pip install 'moonep[bench]'" in lines[0]
    monkeypatch.setitem(sys.modules, "cupy", None)
    lines = cli.missing_packages(plot=False, device="cuda")
    assert len(lines) == 1 and "cupy" in lines[0] and "moonep[cuda1" in lines[0]


def _tiny_doc(**point_extra):
    rec = dict(slack=0.0, replicas=1, replica_weight_bytes=2e6, recv_rows_max=128, dispatch_us=10.0,
               combine_us=12.0, dispatch_logical_GBps=0.0123, combine_logical_GBps=1234.6,
               dispatch_wire_GBps=5.2, combine_wire_GBps=35.0, vs_megatron_dispatch=1.5, vs_megatron_combine=2.0)
    pt = dict(tokens=32, hidden=64, experts=16, topk=4, placement="random", maxvio_target=1, maxvio=0.9,
              moonep=[rec], megatron=dict(dispatch_us=15.0, combine_us=24.0, recv_rows_max=140, recv_rows_min=110),
              ceiling=dict(dispatch_us=5.0, GBps=1.0), **point_extra)
    skipped = dict(tokens=32, hidden=64, experts=15, topk=4, placement="random", maxvio_target=1,
                   skipped="15 experts do not divide over 2 ranks")
    return dict(ranks=2, device="cpu", dtype="bf16", machine=dict(cpu="x86_64", cores=2), points=[pt, skipped])


def test_tables_from_a_minimal_document():
    text = tables.tables(_tiny_doc())
    assert text.count("#  legend:") == len(tables.TABLES)
    assert "0.0123" in text and "1235" in text and "5.20" in text and "35.0" in text  # 3 significant digits
    assert "skipped: 15 experts do not divide over 2 ranks" in text
    # no layer step and no symm_mem in this document: their columns drop out, named under the legend
    assert "not in this run: symm_mem dispatch (us)" in text and "moonep training step (us)" in text
    assert "speed-up (x)" not in text.split("# MoE layer training step")[1].split("legend")[0]


@pytest.mark.parametrize("name", ["cpu_bench_8epr_np4.json", "h200x2_suite_2026-12-01.json"])
def test_tables_of_kept_results(name):
    """Kept results print again (the --report path), also those written before the tables changed (the
    2-GPU suite)."""
    text = tables.tables(json.loads((RESULTS / name).read_text()))
    assert text.count("# moonep: time per call") == 1 and "Traceback" not in text
    assert not [c for c in ("d_logGB", "eff_dp", "xSym_d") if c in text]


def test_report_needs_no_progress_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.missing_packages(plot=False, device="cpu", progress=False) == []
    lines = cli.missing_packages(plot=True, device="cpu", progress=False)
    assert len(lines) == 1 and "matplotlib" in lines[0]
    assert len(cli.missing_packages(plot=True, device="cpu")) == 2


def test_report_of_a_missing_file_is_one_line(tmp_path, capsys):
    """``--report`` of a file that is not there (or not JSON): one line naming it, exit 2, no traceback."""
    from moonep.bench.__main__ import main

    for bad in (tmp_path / "nothere.json", tmp_path / "garbage.json"):
        if bad.name == "garbage.json":
            bad.write_text("not json")
        assert main(["--report", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--report: expected a JSON file" in err and str(bad) in err, err
