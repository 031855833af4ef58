"""perf.bench_anchors: the lockstep agreement can fail, missing anchors are skipped with a hint,
and, where the authors' checkouts are present, tritonopt still agrees with them."""

import contextlib
import io
import re

import pytest
import torch

import tritonopt

from _perf import REPO_ROOT, perf_module
from perf._digits import make_mlp
from perf._optimizers import OptimizerStep
from perf.anchors import CHECKOUTS, AnchorMissing, AnchorPair, fosi_anchor, kfac_anchor
from perf.bench_optimizer_step import SIZES, Size

bench = perf_module("bench_anchors")
TINY = Size("tiny", lambda: make_mlp(0), 8, (64,), 10, window=4, block_size=1024, kfac_inv_every=2,
            fosi=dict(lr=1e-3, base="adam", k=2, l=0, alpha=0.1, curvature_update_every=3))
ANCHORS = REPO_ROOT / ".anchors"


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
