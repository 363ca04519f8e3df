"""The Python in README.md and docs/: every block parses, and a block marked as a program
(``<!-- runs: ... -->`` on the line before it) runs, as a process of its own, where what it
needs is there (the GPU job)."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import needs_gpu, needs_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARK = "<!-- runs:"


def python_blocks():
    """Every ```python block of README.md and docs/*.md, as (place, code, marked to run)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        k = 0
        while k < len(lines):
            if lines[k].strip() == "```python":
                start = k + 1
                end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
                marked = k > 0 and lines[k - 1].strip().startswith(MARK)
                place = f"{path.relative_to(ROOT)}:{start}"
                found.append((place, "\n".join(lines[start:end]) + "\n", marked))
                k = end
            k += 1
    return found


def test_every_python_block_of_the_docs_parses():
    blocks = python_blocks()
    assert len(blocks) >= 5, blocks
    broken = []
    for place, code, _ in blocks:
        try:
            ast.parse(code)
        except SyntaxError as e:
            broken.append(f"{place}: {e}")
    assert not broken, broken


def test_the_python_programs_of_the_docs_run():
    programs = [(place, code) for place, code, marked in python_blocks() if marked]
    assert programs, "README.md marks its Python program to run"
    needs_gpu("the documented programs use PyTorch on the GPU")
    needs_module("torch")
    for place, code in programs:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMM_MEMORY_")}
        ran = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert ran.returncode == 0, f"{place}:\n{ran.stdout}\n{ran.stderr}"
