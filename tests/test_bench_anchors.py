"""perf.bench_anchors: the lockstep agreement can fail, missing anchors are skipped with a hint,
a checkout that does not import stops the run, and, where the authors' checkouts are present
(``.anchors/``, or the folder ``ANCHORS_DIR`` names), the smoke run measures every pair and
tritonopt still agrees with them."""

import contextlib
import importlib.metadata
import io
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import tritonopt

from _perf import REPO_ROOT, modules_set_aside, output_of, perf_module, read_csv, run_script
from perf import _harness as harness
from perf._digits import make_mlp
from perf._optimizers import OptimizerStep
from perf.anchors import (CHECKOUTS, AnchorBroken, AnchorMissing, AnchorPair, _stub_module,
                          fosi_anchor, kfac_anchor)
from perf.bench_optimizer_step import SIZES, Size

bench = perf_module("bench_anchors")
TINY = Size("tiny", lambda: make_mlp(0), 8, (64,), 10, window=4, block_size=1024, kfac_inv_every=2,
            fosi=dict(lr=1e-3, base="adam", k=2, l=0, alpha=0.1, curvature_update_every=3))
ANCHORS = Path(os.environ.get("ANCHORS_DIR") or REPO_ROOT / ".anchors")
PAIRS = {"KFAC+SGD", "FOSI-Adam", "S-MFAC", "MFAC"}


def sgd_pair(anchor_lr: float) -> AnchorPair:
    def sgd(lr):
        return lambda model: OptimizerStep(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    return AnchorPair("SGD", "torch", sgd(0.1), sgd(anchor_lr), agreement_steps=4, rtol=1e-6)


def test_identical_optimizers_agree_exactly():
    assert bench.agreement(sgd_pair(0.1), TINY, torch.device("cpu")) == 0.0


def test_a_one_in_a_thousand_change_of_the_update_is_seen():
    # The updates differ by 1e-3 of their size; the rounding of the stored parameters that the
    # measure forgives is eps * |theta| ~ 1e-8, far below it.
    difference = bench.agreement(sgd_pair(0.1 * (1 + 1e-3)), TINY, torch.device("cpu"))
    assert 0.9e-3 < difference < 1.1e-3


def test_the_profile_splits_each_sides_step_and_tells_them_apart():
    # torch's SGD with a 10x larger lr does the same work: each side's rows sum to at most its total.
    table = bench.profile_steps(sgd_pair(1.0), TINY, torch.device("cpu"), iterations=3, top=4)
    sides = {row[0] for row in table}
    assert sides == {"SGD", "torch"} and len(table) == 2 * 5
    for side in sides:
        rows = [row for row in table if row[0] == side]
        assert rows[0][1] == "(whole step)" and rows[0][4] == "100 %"
        parts = [float(row[3]) for row in rows[1:]]
        assert parts == sorted(parts, reverse=True) and sum(parts) <= float(rows[0][3]) + 1e-3
    assert bench._readable("<method 'view' of 'torch._C.TensorBase' objects>") == "Tensor.view"
    assert bench._readable("<built-in method torch.topk>") == "torch.topk"


def test_the_kernel_profile_counts_each_sides_calls_and_time():
    table = bench.kernel_steps(sgd_pair(1.0), TINY, torch.device("cpu"), iterations=3, top=4)
    sides = {row[0] for row in table}
    assert sides == {"SGD", "torch"}
    for side in sides:
        rows = [row for row in table if row[0] == side]
        assert rows[0][1] == "(whole step)" and rows[0][4] == "100 %" and len(rows) == 5
        assert float(rows[0][2]) >= max(float(row[2]) for row in rows[1:]) > 0
        parts = [float(row[3]) for row in rows[1:]]
        assert parts == sorted(parts, reverse=True) and sum(parts) <= float(rows[0][3]) + 1e-3
        assert any(row[1].startswith("aten::") for row in rows[1:])


def test_missing_anchors_are_skipped_with_how_to_get_them(tmp_path):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = bench.main(["--smoke", "--anchors", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    text = stdout.getvalue()
    assert status == 0, text
    for module in bench.anchor_modules():
        assert f"skipped {module.__name__.rsplit('.', 1)[-1]}" in text, text
    assert text.count("make anchors") >= len(bench.anchor_modules()), text
    assert "nothing measured" in text


@pytest.mark.parametrize("module, repository", [(kfac_anchor, "gpauloski/kfac-pytorch"),
                                                (fosi_anchor, "hsivan/fosi")])
def test_a_missing_checkout_names_its_repository(module, repository, tmp_path):
    with pytest.raises(AnchorMissing, match=f"no checkout of {repository} at .*make anchors"):
        module.pairs(tmp_path, TINY)


def present(module) -> list[AnchorPair]:
    try:
        return module.pairs(ANCHORS, SIZES["demo"])
    except AnchorMissing as missing:
        pytest.skip(str(missing))


@pytest.mark.parametrize("module", [kfac_anchor, fosi_anchor])
def test_tritonopt_agrees_with_the_anchor_where_it_is_present(module):
    for pair in present(module):
        # The bound is derived for the CPU path the benchmark times (the interpreter is only slower).
        with tritonopt.use_backend("reference"):
            difference = bench.agreement(pair, SIZES["demo"], torch.device("cpu"))
        assert difference <= pair.rtol, (pair.name, difference)


def test_the_anchors_folder_is_ignored_by_git():
    assert ".anchors/" in (REPO_ROOT / ".gitignore").read_text().splitlines()


def test_make_anchors_fetches_every_checkout_at_a_pinned_commit():
    makefile = (REPO_ROOT / "Makefile").read_text()
    for folder, repository in CHECKOUTS.items():
        assert re.search(rf"\b{folder}={repository}@[0-9a-f]{{40}}\b", makefile), folder


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def test_a_plain_clone_of_kfac_pytorch_imports(tmp_path):
    # Its package asks for its installed version at import; a clone under .anchors/ is not installed.
    try:
        pytest.skip(f"kfac-pytorch {importlib.metadata.version('kfac-pytorch')} is installed here")
    except importlib.metadata.PackageNotFoundError:
        pass
    write_files(tmp_path / "kfac-pytorch", {
        "pyproject.toml": '[project]\nname = "kfac_pytorch"\nversion = "9.8.7"\n',
        "kfac/__init__.py": "import importlib.metadata\n"
                            "__version__ = importlib.metadata.version('kfac-pytorch')\n",
        "kfac/preconditioner.py": "class KFACPreconditioner:\n    pass\n",
    })
    with modules_set_aside("kfac"):
        module = kfac_anchor.load(tmp_path)
        assert module.KFACPreconditioner.__module__ == "kfac.preconditioner"
        assert sys.modules["kfac"].__version__ == "9.8.7"
    # The stand-in metadata answered that import only.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kfac-pytorch")


def test_a_checkout_that_does_not_import_stops_the_run(tmp_path):
    write_files(tmp_path / "kfac-pytorch", {"kfac/__init__.py": "import a_module_nobody_installed\n"})
    stdout, stderr = io.StringIO(), io.StringIO()
    with (modules_set_aside("kfac"), contextlib.redirect_stdout(stdout),
          contextlib.redirect_stderr(stderr)):
        status = bench.main(["--smoke", "--anchors", str(tmp_path), "--out", str(tmp_path / "out")])
    text = stdout.getvalue() + stderr.getvalue()
    assert status == 1, text
    # The import error, where, and how to fix it; the checkouts that are not there are skipped.
    assert "a_module_nobody_installed" in stderr.getvalue(), text
    assert f"{tmp_path / 'kfac-pytorch'} is there" in stderr.getvalue(), text
    assert "make anchors" in stderr.getvalue(), text
    assert "skipped fosi_anchor" in text and "skipped efcp" in text, text
    assert not (tmp_path / "out").exists()


def test_fosi_without_torchopt_is_an_error_not_a_skip(tmp_path, monkeypatch):
    (tmp_path / "fosi" / "fosi").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "torchopt", None)  # not installed
    with pytest.raises(AnchorBroken, match="torchopt.*make anchors"):
        fosi_anchor.pairs(tmp_path, TINY)


@pytest.mark.parametrize("tqdm", [None, _stub_module("tqdm")], ids=["absent", "a stand-in module"])
def test_progress_is_a_bar_whatever_answers_to_tqdm(tqdm, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", tqdm)
    with harness.progress(2, "pairs", unit="pair") as bar:
        bar.set_description("pairs: one")
        bar.update(1)


@pytest.mark.smoke
def test_smoke_run_with_the_checkouts(tmp_path):
    absent = [CHECKOUTS[folder] for folder in CHECKOUTS if not (ANCHORS / folder).is_dir()]
    if absent:
        pytest.skip(f"no checkout of {', '.join(absent)} under {ANCHORS} (`make anchors`)")
    result = run_script("bench_anchors", "--smoke", "--anchors", str(ANCHORS), "--out", str(tmp_path))
    assert result.returncode == 0, output_of(result)
    assert "skipped" not in result.stdout, output_of(result)
    rows = read_csv(tmp_path / "anchors.csv")
    assert {row["algorithm"] for row in rows} == PAIRS, output_of(result)
    for row in rows:
        assert float(row["step_ratio_min"]) <= float(row["step_ratio_max"]), row


def test_only_names_the_pairs_the_anchors_define():
    """--only takes exactly the pair names the anchor modules give, and refuses others."""
    assert set(bench.ALGORITHMS) == PAIRS
    assert bench.parser().parse_args(["--only", "KFAC+SGD"]).only == ["KFAC+SGD"]
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--only", "K-FAC"])


@pytest.mark.smoke
def test_smoke_run_of_one_pair(tmp_path):
    if not (ANCHORS / "kfac-pytorch").is_dir():
        pytest.skip(f"no checkout of kfac-pytorch under {ANCHORS} (`make anchors`)")
    result = run_script("bench_anchors", "--smoke", "--anchors", str(ANCHORS), "--out", str(tmp_path),
                        "--only", "KFAC+SGD")
    assert result.returncode == 0, output_of(result)
    assert {row["algorithm"] for row in read_csv(tmp_path / "anchors.csv")} == {"KFAC+SGD"}, output_of(result)
