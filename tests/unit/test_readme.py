"""Every ```python block of README.md, docs/api.md and docs/integrations.md runs, as its own script, in a fresh
process.

Each block is one test: it is written to a file in a temporary directory and run there with
``sys.executable`` (``PYTHONPATH`` = the repository root, ``OMP_NUM_THREADS=1``, no launcher variables, so
``moonep.init()`` is a single process), and must exit 0 within ``TIMEOUT`` seconds. A block whose fence
is directly preceded by a line ``<!-- not run: REASON -->`` is skipped with that reason.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.mp import run_bounded

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = (README, REPO_ROOT / "docs" / "api.md", REPO_ROOT / "docs" / "integrations.md")  # blocks that run as written
TIMEOUT = 240
LANGS = {"python", "python3", "py"}
_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$", re.IGNORECASE)
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMI_ID", "HYDRA_CONTROL_FD", "RANK",
                  "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_LOCAL_RANK")


@dataclass
class Block:
    index: int
    line: int          # 1-based line of the opening fence
    code: str
    skip: str | None   # the reason of a ``<!-- not run: ... -->`` marker

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "(empty)")


def python_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text whose info string is python (CommonMark fences)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        fence, indent, start = m["fence"], len(m["indent"]), i
        words = m["info"].split()
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, i = [], i + 1
        while i < len(lines) and not close.match(lines[i]):
            ln = lines[i]
            strip = len(ln) - len(ln.lstrip(" "))
            body.append(ln[min(indent, strip):])
            i += 1
        i += 1  # past the closing fence (or the end of the file: an unclosed block runs to the end)
        if words and words[0].lower() in LANGS:
            prev = start - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            marker = _NOT_RUN.match(lines[prev]) if prev >= 0 else None
            blocks.append(Block(len(blocks), start + 1, "\n".join(body) + "\n",
                                (marker["reason"] or "no reason given") if marker else None))
    return blocks


def _blocks():
    return [(path, b) for path in DOCS if path.exists() for b in python_blocks(path.read_text(encoding="utf-8"))]


def _id(path: Path, block: Block) -> str:
    first = re.sub(r"\s+", " ", block.first_line)
    return f"{path.stem}-{block.index}-L{block.line}-{first[:40]}"


BLOCKS = _blocks()


@pytest.mark.parametrize("path,block", [pytest.param(p, b, id=_id(p, b)) for p, b in BLOCKS])
def test_readme_block_runs(path, block, tmp_path):
    name = path.relative_to(REPO_ROOT)
    if block.skip is not None:
        pytest.skip(f"{name}:{block.line}: not run: {block.skip}")
    script = tmp_path / f"readme_block_{block.index}.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    rc, out, err, timed_out = run_bounded([sys.executable, str(script)], timeout=TIMEOUT, env=env, cwd=tmp_path)
    if timed_out or rc != 0:
        numbered = "\n".join(f"{block.line + n:5d} | {ln}" for n, ln in enumerate(block.code.splitlines(), 1))
        why = f"timed out after {TIMEOUT}s" if timed_out else f"exit code {rc}"
        pytest.fail(f"{name} block {block.index} (line {block.line}) {why}\n{numbered}\n"
                    f"--- stderr (tail) ---\n{err[-6000:]}\n--- stdout (tail) ---\n{out[-2000:]}", pytrace=False)


# The extractor itself, on a made-up README (so it is checked whatever README.md says today).
def test_python_blocks_extraction():
    text = "\n".join([
        "# Title",
        "```python",
        "print(1)",
        "```",
        "```bash",
        "echo no",
        "```",
        "<!-- not run: needs two GPUs -->",
        "",
        "````python title",
        "x = '''",
        "```",
        "'''",
        "````",
        "- item",
        "  ```py",
        "  if True:",
        "      pass",
        "  ```",
        "```pycon",
        ">>> 1",
        "```",
        "~~~Python",
        "print(2)",
        "~~~",
        "```",
        "plain",
        "```",
    ])
    blocks = python_blocks(text)
    assert [b.line for b in blocks] == [2, 10, 16, 23]
    assert blocks[0].code == "print(1)\n" and blocks[0].skip is None and blocks[0].first_line == "print(1)"
    assert blocks[1].skip == "needs two GPUs" and blocks[1].code == "x = '''\n```\n'''\n"
    assert blocks[2].code == "if True:\n    pass\n"
    assert blocks[3].code == "print(2)\n"
    assert [b.index for b in blocks] == [0, 1, 2, 3]
