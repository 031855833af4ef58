"""The M-FAC family's anchor pairs (perf/anchors/efcp.py) on a tiny MLP.

Without a checkout of IST-DASLab/EFCP: tritonopt's sides train, and ``pairs`` says what is
missing. With one under ``.anchors/EFCP`` (or the folder ``ANCHORS_DIR`` names): both sides of
every pair agree after 3 steps within the pair's bound. Fake checkouts show how the loader
treats one that does not import, and that its stand-in logging modules stay its own.
"""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
from _perf import modules_set_aside

from perf import _harness as harness
from perf.anchors import AnchorBroken, AnchorMissing, _stub_module, efcp
from perf.bench_optimizer_step import Size

EFCP_CHECKOUT = Path(os.environ.get("ANCHORS_DIR")
                     or Path(__file__).resolve().parents[1] / ".anchors")


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


TINY = Size("tiny", tiny_mlp, batch=8, input_shape=(16,), classes=4, window=4, block_size=64,
            kfac_inv_every=1, fosi={})


def batches(count: int) -> list:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(TINY.batch, *TINY.input_shape, generator=generator),
             torch.randint(0, TINY.classes, (TINY.batch,), generator=generator))
            for _ in range(count)]


def train(build, model: torch.nn.Module, data) -> torch.Tensor:
    step = build(model)
    for x, y in data:
        step(x, y, torch.nn.functional.cross_entropy)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", ["S-MFAC", "MFAC"])
def test_tritonopt_side_trains_without_the_checkout(name):
    model = tiny_mlp()
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    theta = train(efcp.tritonopt_builders(TINY)[name], model, batches(2))
    assert torch.isfinite(theta).all()
    assert not torch.equal(theta, start)


def test_missing_checkout_names_the_repository(tmp_path):
    with pytest.raises(AnchorMissing, match="IST-DASLab/EFCP"):
        efcp.pairs(tmp_path, TINY)


def test_too_small_a_model_for_a_count_is_refused():
    # 1 % of 676 parameters keeps 7; at 0.1 % it would keep 1, which EFCP would read as 100 %.
    assert efcp.kept_entries(tiny_mlp(), 0.01) == 7
    with pytest.raises(ValueError, match="at least 2"):
        efcp.kept_entries(tiny_mlp(), 0.001)


def test_unpivoted_lu_stand_in_factors_the_matrix():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 40, generator=generator)
    matrix = rows @ rows.T / 0.03 + 6 * torch.eye(6)  # EFCP's lambd * G G^T + m I
    packed, pivots = efcp._unpivoted_lu_from_cholesky(torch.lu)(matrix, pivot=False)
    lower = packed.tril(-1) + torch.eye(6)
    upper = packed.triu()
    torch.testing.assert_close(lower @ upper, matrix, rtol=1e-5, atol=1e-4)
    assert torch.equal(pivots, torch.arange(1, 7, dtype=torch.int32))


def test_logging_stub_fails_dunder_lookups_like_a_module():
    stub = _stub_module("an_experiment_logger")
    assert stub.log() is None
    with pytest.raises(AttributeError):
        stub.__file__


def test_pairs_agree_with_the_checkout():
    if not (EFCP_CHECKOUT / "EFCP").is_dir():
        pytest.skip(f"no checkout of IST-DASLab/EFCP under {EFCP_CHECKOUT}")
    data = batches(3)
    for pair in efcp.pairs(EFCP_CHECKOUT, TINY):
        base = tiny_mlp()
        ours = train(pair.build_tritonopt, copy.deepcopy(base), data)
        theirs = train(pair.build_anchor, copy.deepcopy(base), data)
        start = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
        scale = theirs.abs().max()
        # The steps moved theta far more than the bound.
        assert (theirs - start).abs().max() > 100 * pair.rtol * scale, pair.name
        assert (ours - theirs).abs().max() <= pair.rtol * scale, pair.name


def fake_checkout(anchors_dir: Path, sparse_source: str) -> None:
    """An EFCP checkout whose two optimizer modules import what EFCP's import (and ``sparse_source``)."""
    sparse = anchors_dir / "EFCP" / "optimizers" / "sparse"
    dense = anchors_dir / "EFCP" / "optimizers" / "dense"
    sparse.mkdir(parents=True)
    dense.mkdir(parents=True)
    sparse_class = "class SparseGradientMFAC:\n    pass\n"
    (sparse / "SparseGradientMFAC.py").write_text(sparse_source + sparse_class)
    (dense / "MFAC.py").write_text("import wandb\nclass DenseMFAC:\n    pass\n")


def test_logging_stand_ins_stay_with_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm not installed
    fake_checkout(tmp_path, "import tqdm\nimport wandb\nfrom tqdm import tqdm as progress_bar\n")
    before = {name: sys.modules.get(name, "absent") for name in efcp.LOGGING_MODULES}
    with modules_set_aside("optimizers", "helpers"):
        classes = efcp._load(tmp_path)
        sparse_module = sys.modules[classes["SparseMFAC"].__module__]
    # The checkout's modules got their stand-ins ...
    assert sparse_module.progress_bar() is None and sparse_module.wandb.log() is None
    # ... and the rest of the process finds each package as before: missing, or (where it is
    # installed but was not imported yet) the real one, from its file.
    for name in efcp.LOGGING_MODULES:
        after = sys.modules.get(name, "absent")
        assert after is before[name] or getattr(after, "__file__", None), (name, after)
    with pytest.raises(ImportError):
        import tqdm  # noqa: F401
    with harness.progress(1, "pairs", unit="pair") as bar:  # the silent stand-in, not None
        bar.update(1)


def test_a_checkout_that_does_not_import_is_an_error_not_a_skip(tmp_path):
    fake_checkout(tmp_path, "raise RuntimeError('needs a GPU build of something')\n")
    with modules_set_aside("optimizers", "helpers"), pytest.raises(AnchorBroken) as raised:
        efcp.pairs(tmp_path, TINY)
    message = str(raised.value)
    assert "needs a GPU build of something" in message and "make anchors" in message
    assert str(tmp_path / "EFCP") in message
