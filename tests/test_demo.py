"""The demo trains every optimizer, writes its table, curves and figure, and docs/demo.md quotes its table."""

import importlib.util
import math
import re
import shutil
import subprocess

import pytest

from _perf import REPO_ROOT, output_of, perf_module, read_csv, smoke_run

pytest.importorskip("sklearn")


@pytest.mark.smoke
def test_one_epoch_of_every_optimizer():
    result, out = smoke_run("demo_digits")
    assert result.returncode == 0, output_of(result)
    demo = perf_module("demo_digits")
    rows = read_csv(out / "demo_digits.csv")
    assert [row["optimizer"] for row in rows] == list(demo.BUILDERS)
    for row in rows:
        # One epoch from the initial ln(10) = 2.30 must already help every optimizer.
        loss = float(row["final_train_loss"])
        assert math.isfinite(loss) and loss < 1.0, row
        accuracy = float(row["test_accuracy_pct"])
        assert accuracy > 50, row
        assert float(row["test_accuracy_min_pct"]) <= accuracy <= float(row["test_accuracy_max_pct"])
        assert int(row["state_bytes"]) > 0 and float(row["ms_per_step"]) > 0
    curves = read_csv(out / "demo_digits_curves.csv")
    assert {row["optimizer"] for row in curves} == set(demo.BUILDERS)
    for row in curves:  # epoch 0: before training, at 0 s
        assert (float(row["seconds_in_steps"]) > 0) == (int(row["epoch"]) > 0), row
        assert float(row["train_loss"]) > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "demo_digits.png").stat().st_size > 0


def test_split_and_model_match_the_documented_protocol():
    digits = perf_module("_digits")
    data = digits.load_digits_split()
    assert len(data.y_train) == 1437 and len(data.y_test) == 360
    assert sum(p.numel() for p in digits.make_mlp(0).parameters()) == 85_002


def test_bad_arguments_are_refused():
    demo = perf_module("demo_digits")
    with pytest.raises(SystemExit):
        demo.parse_args(["--epochs", "0"])
    with pytest.raises(SystemExit, match="matched none"):
        demo.main(["--only", "NoSuchOptimizer", "--epochs", "1"])


def markdown_table(text: str) -> list[str]:
    """The rows of the first markdown table in ``text`` that lists the demo's optimizers."""
    return [line for line in text.splitlines() if re.match(r"\| (SGD|Adam|SparseAdaGrad|M-FAC|S-MFAC|LR-MFAC|K-FAC|FOSI)", line)]


def test_the_docs_quote_the_committed_demo_table():
    section = (REPO_ROOT / "docs" / "demo.md").read_text()
    committed = (REPO_ROOT / "perf" / "results" / "demo" / "demo_digits.md").read_text()
    assert markdown_table(section) == markdown_table(committed)
    assert len(markdown_table(committed)) == len(perf_module("demo_digits").BUILDERS)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_demo_writes_to_an_ignored_folder_by_default():
    demo = perf_module("demo_digits")
    target = demo.DEFAULT_OUT.relative_to(REPO_ROOT) / "demo_digits.png"
    assert subprocess.run(["git", "check-ignore", "-q", str(target)], cwd=REPO_ROOT).returncode == 0


def committed_rows() -> dict[str, dict]:
    """The committed demo table's numbers, keyed by the optimizer's name (before its settings)."""
    rows = {}
    for line in markdown_table((REPO_ROOT / "perf" / "results" / "demo" / "demo_digits.md").read_text()):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].split(" (")[0]] = {"loss": float(cells[1]), "accuracy": float(cells[2].rstrip(" %"))}
    return rows


@pytest.mark.slow
def test_a_fresh_run_reproduces_the_committed_table(tmp_path):
    """The full demo (about a minute) against the committed table.

    The figures are deterministic on one machine but not across processors: the
    BLAS kernels torch picks for a CPU add in another order, and 450 steps carry
    that rounding into different last digits (one test image is 0.14 points of
    the two seeds' mean). The bound says nothing changed in substance: each
    optimizer's mean test accuracy within 1 point (7 images) and its final
    training loss within a factor of 2 of the committed ones.
    """
    rows = perf_module("demo_digits").main(["--out", str(tmp_path), "--no-plot"])
    committed = committed_rows()
    assert len(rows) == len(committed)
    for row in rows:
        name = row["optimizer"].split(" (")[0]
        expected = committed[name]
        assert abs(float(row["test_accuracy_pct"]) - expected["accuracy"]) <= 1.0, (name, row, expected)
        ratio = float(row["final_train_loss"]) / expected["loss"]
        assert 0.5 <= ratio <= 2.0, (name, row, expected)
