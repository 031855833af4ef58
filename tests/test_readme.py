"""The Python examples of the README and of the pages under docs/ run as written.

Whole scripts (the README's first example) run as they are. Fragments (the
optimizer loops, which name a ``model``, a ``loader`` and a ``loss_fn`` they do
not build) run in order, one namespace per document, that provides those
three on a small task. A block that is a whole script for ``torchrun``
(its first line says so) runs under ``torchrun`` on 2 gloo ranks, and what it
prints must be what the README shows after it. Fragments of a multi-rank
program, which need a process group and per-rank data the README leaves out,
are listed with the tests that cover them instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
TORCHRUN_SCRIPT = re.compile(r"^# (\w+\.py): torchrun --nproc_per_node (\d+) \1(?: \[(\w+)(?:\|(\w+))*\])?")

# Multi-rank fragments, and where their behaviour is tested.
MULTI_RANK_FRAGMENTS = {
    "KAISAPreconditioner(model, grad_worker_fraction": "tests/test_kaisa.py",
    "tritonopt.dist.DSPStage(": "tests/test_dsp_distributed.py",
    "register_comm_hook(": "tests/test_comm_hooks.py",
}


@dataclass
class Block:
    document: str
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


def readme_blocks() -> list[Block]:
    """Every fenced block of every document, in document order."""
    blocks = []
    for path in DOCUMENTS:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        blocks += [Block(name, text[: m.start()].count("\n") + 1, m.group(1), m.group(2))
                   for m in FENCE.finditer(text)]
    return blocks


def python_blocks() -> list[Block]:
    return [b for b in readme_blocks() if b.language == "python"]


def is_multi_rank_fragment(block: Block) -> bool:
    return not TORCHRUN_SCRIPT.match(block.code) and (
        "init_process_group" in block.code or any(marker in block.code for marker in MULTI_RANK_FRAGMENTS))


def fragment_namespace() -> dict:
    """What the fragments take as given: a classifier, its data loader and its loss."""
    import tritonopt
    import tritonopt.optim  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 10, generator=gen)
    batches = []
    for _ in range(6):
        x = torch.randn(32, 64, generator=gen)
        batches.append((x, (x @ teacher).argmax(1)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return {"torch": torch, "tritonopt": tritonopt, "model": model, "loader": batches,
            "loss_fn": torch.nn.functional.cross_entropy}


def test_every_python_block_is_run_or_accounted_for():
    blocks = python_blocks()
    assert blocks, "the README has no Python examples"
    for block in blocks:
        if is_multi_rank_fragment(block):
            assert any(marker in block.code for marker in MULTI_RANK_FRAGMENTS), (
                f"{block.id} needs a process group but names no test that covers it")
            for marker, test in MULTI_RANK_FRAGMENTS.items():
                if marker in block.code:
                    assert (ROOT / test).exists(), f"{block.id} is covered by {test}, which does not exist"


def test_fragments_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples save checkpoints to the working directory
    namespaces: dict[str, dict] = {}
    ran = 0
    for block in python_blocks():
        if is_multi_rank_fragment(block) or TORCHRUN_SCRIPT.match(block.code) or block == first_script():
            continue  # the whole scripts run as users run them, in their own process (-m smoke)
        namespace = namespaces.setdefault(block.document, fragment_namespace())
        try:
            exec(compile(block.code, block.id, "exec"), namespace)
        except Exception as error:  # name the block, not this test's line
            raise AssertionError(f"the example at {block.id} fails: {error!r}") from error
        ran += 1
    assert ran >= 5


def torchrun_scripts() -> list[tuple[Block, str, int, list[str], str]]:
    """Each torchrun script with its file name, rank count, variants and the output the README shows."""
    blocks = readme_blocks()
    found = []
    for i, block in enumerate(blocks):
        match = TORCHRUN_SCRIPT.match(block.code) if block.language == "python" else None
        if not match:
            continue
        variants = [v for v in re.findall(r"\[(.*?)\]", block.code.splitlines()[0])[0].split("|")] if match.group(3) else [""]
        shown = blocks[i + 1]
        assert shown.language == "", f"{block.id}: the document should show what the script prints right after it"
        found.append((block, match.group(1), int(match.group(2)), variants, shown.code))
    return found


@pytest.mark.smoke
@pytest.mark.parametrize("script", torchrun_scripts(), ids=lambda s: s[0].id)
def test_torchrun_scripts_print_what_the_readme_shows(script, tmp_path):
    block, filename, ranks, variants, shown = script
    (tmp_path / filename).write_text(block.code)
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack into the failure message
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    printed = []
    for variant in variants:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--standalone", filename] + ([variant] if variant else [])
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{block.id} {variant}: exit {result.returncode}\n{result.stderr[-3000:]}"
        printed.append(result.stdout)
    assert "".join(printed).split() == shown.split()


def first_script() -> Block:
    """The README's first example: a whole training script."""
    return next(b for b in python_blocks() if b.document == "README.md")


@pytest.mark.smoke
def test_the_first_script_trains_as_the_readme_says(tmp_path):
    """The README's first example, run alone as a user on a CPU runs it (no Triton interpreter: the
    references), prints a loss, an accuracy and a state size like those it quotes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", first_script().code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = re.fullmatch(r"loss ([\d.]+), training accuracy ([\d.]+)%, optimizer state (\d+) KiB\n", result.stdout)
    assert printed, result.stdout
    quoted = re.search(r"prints `loss ([\d.]+), training accuracy ([\d.]+)%, optimizer state (\d+) KiB`",
                       README.read_text())
    assert quoted, "the README should quote what its first script prints"
    # The state size is exact; the loss and accuracy may differ in the last digits on another processor.
    assert printed.group(3) == quoted.group(3)
    assert abs(float(printed.group(2)) - float(quoted.group(2))) <= 1.0
    assert float(printed.group(1)) <= 2 * float(quoted.group(1))
