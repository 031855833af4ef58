"""The demo trains every registered optimizer and writes its table and plot."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

DEMO = Path(__file__).resolve().parents[1] / "perf" / "demo_digits.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("demo_digits", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_one_epoch_of_every_optimizer(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONOPT_BACKEND", "reference")  # what a CPU user runs; fast
    demo = load_demo()
    rows = demo.main(["--epochs", "1", "--seeds", "1", "--out", str(tmp_path)])
    assert [row["optimizer"] for row in rows] == list(demo.BUILDERS)
    for row in rows:
        # One epoch from the initial ln(10) = 2.30 must already help every optimizer.
        assert math.isfinite(row["final_train_loss"]) and row["final_train_loss"] < 1.0, row
        assert row["test_accuracy_pct"] > 50, row
        assert row["state_bytes"] > 0 and row["ms_per_step"] > 0
    for name in ("demo_digits.csv", "demo_digits.md", "demo_digits.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_split_and_model_match_the_documented_protocol():
    demo = load_demo()
    data = demo.load_digits_split()
    assert len(data.y_train) == 1437 and len(data.y_test) == 360
    assert sum(p.numel() for p in demo.make_mlp(0).parameters()) == 85_002


def test_bad_arguments_are_refused():
    demo = load_demo()
    with pytest.raises(SystemExit):
        demo.parse_args(["--epochs", "0"])
    with pytest.raises(SystemExit, match="matched none"):
        demo.main(["--only", "NoSuchOptimizer", "--epochs", "1"])
