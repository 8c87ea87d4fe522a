"""Linear layers with packed weights (the panel kernel or oneDNN) compute the same matmul as
`F.linear`; the panel kernel itself against a float64 reference.

Panel kernel tolerances against float64: float32 1e-5 of the largest |output|; bfloat16 the
rounding of one result (2^-8 relative) plus 1e-4 of the largest |output| (float32 sums)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.nn.functional as F
from structlog.testing import CapturedCall
from torch import nn

from specserve.worker.cpu import kernels
from specserve.worker.cpu import linear as linear_module
from specserve.worker.cpu.linear import (
    Linear,
    PackedWeight,
    calibrate_large_rows_blas,
    calibrate_min_rows,
    can_pack,
    pack_weight,
    pack_weights,
)
from specserve.worker.loader import load_model
from tests.model_checkpoints import Checkpoint

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2)), reason="neither the panel kernel nor oneDNN runs here"
)
PANEL_DTYPES = [
    pytest.param(
        dtype,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(
            dtype not in kernels.linear_dtypes(),
            reason=f"the panel kernel does not run {dtype} on this CPU",
        ),
    )
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.fixture(autouse=True)
def private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Calibrations are cached in a test's own folder (the kernels stay where they are)."""
    monkeypatch.setenv("SPECSERVE_KERNELS_DIR", str(kernels.kernels_dir()))
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_panel_result(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == expected.shape
    scale = expected.abs().max().item()
    err = (got.double() - expected).abs()
    if dtype == torch.bfloat16:
        allowed = expected.abs() * 2**-8 + 1e-4 * scale
    else:
        allowed = torch.full_like(expected, 1e-5 * scale)
    assert (err <= allowed).all(), f"max error {err.max().item()} (scale {scale})"


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 28, 29, 61])
# A partial panel and odd K; on CPUs with AMX tiles, bfloat16 runs from 4 rows on the tiles where
# K is a multiple of 32 (960 x 576: an even count of panels; 100 x 64: an odd one, partial).
@pytest.mark.parametrize(("n", "k"), [(50, 37), (960, 576), (100, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_kernel_matches_float64(
    dtype: torch.dtype, rows: int, n: int, k: int, with_bias: bool
) -> None:
    """One tile (1-28 rows on AVX-512, 6 on AVX2) and several, split evenly (29 as 15 and 14,
    61 as three); a last panel of 2 columns, an odd K (a zero-padded bfloat16 pair), bias; the
    input rows strided (a column slice)."""
    g = torch.Generator().manual_seed(rows * n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, k + 3, generator=g).to(dtype)[:, 2 : 2 + k]
    assert x.stride(0) == k + 3
    got = kernels.panel_linear(x, kernels.pack_panels(w), b, n)
    _assert_panel_result(got, _reference(x, w, b), dtype)


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Bit for bit whatever tile a row lands in: a request's logits must not change with the
    batch around it (a verified draft row against the same token decoded alone), or greedy
    speculation would not be lossless."""
    g = torch.Generator().manual_seed(7)
    n, k = 100, 576
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    x = torch.randn(70, k, generator=g).to(dtype)
    panels = kernels.pack_panels(w)
    alone = torch.cat([kernels.panel_linear(x[i : i + 1], panels, None, n) for i in range(70)])
    for rows in (2, 16, 17, 28, 29, 45, 57, 70):
        assert torch.equal(kernels.panel_linear(x[:rows], panels, None, n), alone[:rows]), rows


def test_bfloat16_panels_run_on_amx_tiles_where_the_cpu_has_them() -> None:
    """The library asks for the tile state at load; a CPU with AMX tiles and the bfloat16
    panel kernel gets it (the results are checked by the float64 comparisons above)."""
    has_tiles = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if not (has_tiles and torch.bfloat16 in kernels.linear_dtypes()):
        pytest.skip("no AMX tiles or no bfloat16 panel kernel on this CPU")
    assert kernels.linear_amx_min_rows() == 1  # every row: see the test above


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_panel_kernel_keeps_leading_dims_and_nans(dtype: torch.dtype) -> None:
    """`[..., K]` inputs come back as `[..., N]`; a NaN input poisons its own row only."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 24, generator=g).to(dtype)
    x = torch.randn(2, 3, 24, generator=g).to(dtype)
    x[1, 2, 5] = float("nan")
    got = kernels.panel_linear(x, kernels.pack_panels(w), None, 33)
    assert got.shape == (2, 3, 33)
    assert got[1, 2].isnan().all() and not got[:1].isnan().any() and not got[1, :2].isnan().any()
    _assert_panel_result(got[0], _reference(x[0], w, None), dtype)


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_panel_layout(dtype: torch.dtype) -> None:
    """Panel p holds output columns 16p..16p+15, K-major (bfloat16: K in pairs), zero-padded."""
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5).to(dtype)
    panels = kernels.pack_panels(w)
    if dtype == torch.bfloat16:
        assert panels.shape == (2, 3, 16, 2)
        assert panels[1, 1, 2, 0] == w[18, 2] and panels[1, 1, 2, 1] == w[18, 3]
        assert panels[0, 2, 7, 0] == w[7, 4] and panels[0, 2, 7, 1] == 0  # K padded to 6
    else:
        assert panels.shape == (2, 5, 16)
        assert panels[1, 3, 2] == w[18, 3] and panels[0, 4, 15] == w[15, 4]
    assert (panels[1, :, 4:] == 0).all()  # columns 20..31 do not exist


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_panel_kernel_refuses_what_does_not_fit(dtype: torch.dtype) -> None:
    w = torch.randn(40, 24).to(dtype)
    panels = kernels.pack_panels(w)
    with pytest.raises(ValueError, match="does not fit panels"):
        kernels.panel_linear(torch.randn(3, 26).to(dtype), panels, None, 40)
    with pytest.raises(ValueError, match="does not fit panels"):
        kernels.panel_linear(torch.randn(3, 24).to(dtype), panels, None, 56)
    with pytest.raises(ValueError, match="bias"):
        kernels.panel_linear(torch.randn(3, 24).to(dtype), panels, torch.zeros(39), 40)


def _packable(dtype: torch.dtype, tol: float) -> object:
    """A (dtype, tol) case, skipped on a CPU that can pack no weight of that dtype (bfloat16
    needs the panel kernel's AVX-512 BF16 or oneDNN's bf16 instructions)."""
    return pytest.param(
        dtype,
        tol,
        id=str(dtype).removeprefix("torch."),
        marks=pytest.mark.skipif(
            not can_pack(torch.empty(2, 2, dtype=dtype)), reason=f"no packed {dtype} linear here"
        ),
    )


@pytest.mark.parametrize(
    ("dtype", "tol"), [_packable(torch.float32, 2e-5), _packable(torch.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(
    dtype: torch.dtype, tol: float, rows: int, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(rows)
    layer = Linear(576, 960, bias=with_bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=g) / 24)
        if with_bias:
            layer.bias.copy_(torch.randn(960, generator=g))
    x = torch.randn(rows, 576, generator=g).to(dtype)
    bias = layer.bias.double() if with_bias else None
    expected = F.linear(x.double(), layer.weight.double(), bias)
    assert len(layer.pack_weights()) == 1
    assert layer.packed is not None
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 960)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tol * scale


def _panel_layer(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[Linear, list[int]]:
    """A panel-packed 576 -> 960 layer with a bias, and the row counts the panel kernel sees."""
    if not linear_module._onednn_runs(torch.empty(2, 2, dtype=dtype)):
        pytest.skip(f"oneDNN does not run {dtype} here")
    layer = Linear(576, 960, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=torch.Generator().manual_seed(1)) / 24)
        layer.bias.uniform_(-1, 1)
    (packed,) = layer.pack_weights()
    assert packed.panels and packed.large_rows_onednn
    panel_rows: list[int] = []
    panel_linear = kernels.panel_linear

    def spy(x, *args):  # type: ignore[no-untyped-def]
        panel_rows.append(x.shape[0])
        return panel_linear(x, *args)

    monkeypatch.setattr(kernels, "panel_linear", spy)
    return layer, panel_rows


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_panels_hand_prompt_sized_inputs_to_onednn(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From PANEL_MAX_ROWS rows on (AMX_PANEL_MAX_ROWS where bfloat16 multiplies on AMX
    tiles), a panel-packed layer runs oneDNN's GEMM on its plain weight (same result within
    the GEMM's rounding); below, the panel kernel."""
    layer, panel_rows = _panel_layer(dtype, monkeypatch)
    assert layer.packed is not None and layer.packed.onednn is None  # no third copy
    on_tiles = dtype == torch.bfloat16 and kernels.linear_amx_min_rows() > 0
    limit = linear_module.AMX_PANEL_MAX_ROWS if on_tiles else linear_module.PANEL_MAX_ROWS
    assert layer.packed.panel_max_rows == layer.packed.onednn_rows == limit
    for rows in (limit - 1, limit, 3 * limit):
        x = torch.randn(rows, 576).to(dtype)
        _assert_panel_result(layer(x), _reference(x, layer.weight, layer.bias), dtype)
    assert panel_rows == [limit - 1]


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_a_calibrated_hand_over_runs_a_blocked_copy(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-over moved below PANEL_MAX_ROWS gives oneDNN inputs of that many rows and more,
    on a blocked copy of the weight that a cast or reload makes again; the hand-over returned to
    PANEL_MAX_ROWS drops the copy."""
    layer, panel_rows = _panel_layer(dtype, monkeypatch)
    packed = layer.packed
    assert packed is not None
    packed.hand_over(16)
    assert packed.onednn is not None and not packed.runs_panels(16) and packed.runs_panels(15)
    for rows in (1, 15, 16, 64, 300):
        x = torch.randn(rows, 576).to(dtype)
        _assert_panel_result(layer(x), _reference(x, layer.weight, layer.bias), dtype)
    assert panel_rows == [1, 15]
    new_weight = torch.randn(960, 576, generator=torch.Generator().manual_seed(2)) / 24
    layer.load_state_dict({"weight": new_weight.to(dtype), "bias": layer.bias.detach()})
    assert layer.packed is not packed and layer.packed.onednn_rows == 16
    x = torch.randn(20, 576).to(dtype)
    _assert_panel_result(layer(x), _reference(x, layer.weight, layer.bias), dtype)
    assert panel_rows == [1, 15]
    layer.packed.hand_over(linear_module.PANEL_MAX_ROWS)
    assert layer.packed.onednn is None and layer.packed.runs_panels(20)
    assert layer.packed.onednn_rows == layer.packed.panel_max_rows  # the weight's own limit


def test_only_weights_on_amx_tiles_keep_prompt_chunks() -> None:
    """bfloat16 weights whose K is a multiple of 32 multiply on the tiles, where there are
    tiles, and keep up to AMX_PANEL_MAX_ROWS rows; the rest hand over at PANEL_MAX_ROWS."""
    if torch.bfloat16 not in kernels.linear_dtypes():
        pytest.skip("the panel kernel does not run bfloat16 here")
    on_tiles = kernels.linear_amx_min_rows() > 0
    for k, dtype, tiles in ((576, torch.bfloat16, on_tiles), (48, torch.bfloat16, False)):
        packed = pack_weight(torch.randn(64, k).to(dtype))
        assert packed is not None and packed.panels
        expected = linear_module.AMX_PANEL_MAX_ROWS if tiles else linear_module.PANEL_MAX_ROWS
        assert packed.panel_max_rows == expected, k
    if torch.float32 in kernels.linear_dtypes():
        packed = pack_weight(torch.randn(64, 576))
        assert packed is not None and packed.panel_max_rows == linear_module.PANEL_MAX_ROWS


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_output_columns_come_from_the_panels_that_hold_them(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forward_columns(x, start)` is `forward`'s columns from `start` on, bit for bit where
    both run the panels (read from a view of the panels, not a copy); past the hand-over,
    and where `start` splits a panel, `F.linear` on those rows of the weight."""
    layer, panel_rows = _panel_layer(dtype, monkeypatch)
    packed = layer.packed
    assert packed is not None
    for rows in (1, 5, 40):
        x = torch.randn(rows, 576).to(dtype)
        assert torch.equal(layer.forward_columns(x, 576), layer(x)[:, 576:])
    assert panel_rows == [1, 1, 5, 5, 40, 40]
    x = torch.randn(3, 576).to(dtype)
    expected = F.linear(x, layer.weight[584:], layer.bias[584:])
    assert torch.equal(layer.forward_columns(x, 584), expected)  # 584 splits a panel
    x = torch.randn(packed.onednn_rows, 576).to(dtype)
    expected = F.linear(x, layer.weight[576:], layer.bias[576:])
    assert torch.equal(layer.forward_columns(x, 576), expected)
    assert panel_rows == [1, 1, 5, 5, 40, 40]


def test_float32_prompt_chunks_run_the_gemm_calibration_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From PANEL_MAX_ROWS rows on, a float32 weight without a blocked copy runs oneDNN's GEMM
    on its plain layout or, where calibration found it faster, `F.linear`'s BLAS: bit for bit
    what that library gives. A reload keeps the choice; below the hand-over, the panels."""
    if torch.float32 not in kernels.linear_dtypes():
        pytest.skip("the panel kernel does not run float32 on this CPU")
    layer, panel_rows = _panel_layer(torch.float32, monkeypatch)
    packed = layer.packed
    assert packed is not None and not packed.large_rows_blas
    x = torch.randn(linear_module.PANEL_MAX_ROWS + 44, 576)
    onednn = linear_module._onednn_linear(x, layer.weight, layer.bias)
    blas = F.linear(x, layer.weight, layer.bias)
    if torch.equal(onednn, blas):
        pytest.skip("oneDNN and the BLAS sum in the same order here: nothing tells them apart")
    assert torch.equal(layer(x), onednn)
    packed.large_rows_blas = True
    assert torch.equal(layer(x), blas)
    layer.load_state_dict({"weight": layer.weight.detach() * 2, "bias": layer.bias.detach()})
    assert layer.packed is not packed and layer.packed.large_rows_blas
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert panel_rows == []
    layer(x[:8])
    assert panel_rows == [8]


@needs_onednn
def test_the_blas_calibration_weighs_each_shape_by_its_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One weight of each shape is timed and counted as often as its shape occurs: three
    layers 10% faster through the BLAS outweigh one 20% slower (3.9 against 4.0, within
    BLAS_MARGIN), not one 30% slower (4.0 against 4.0)."""
    layers = [Linear(64, 48) for _ in range(3)] + [Linear(32, 80)]
    packed = [p for layer in layers for p in layer.pack_weights()]
    if not all(p.panels and p.large_rows_onednn for p in packed):
        pytest.skip("no float32 panels handing over to oneDNN here")
    times = {(48, 64): [1.0, 0.9], (80, 32): [1.0, 1.2]}
    timed: list[tuple[int, ...]] = []

    def best_passes(onednn: list[Callable[[], Any]], blas: list[Callable[[], Any]]) -> list[float]:
        (call,) = onednn
        shape = tuple(call.args[1].shape)
        assert blas[0].args[1] is call.args[1] and call.args[0].shape[0] == 512
        timed.append(shape)
        return times[shape]

    monkeypatch.setattr(linear_module, "_best_passes", best_passes)
    assert calibrate_large_rows_blas(packed) is True
    assert timed == [(48, 64), (80, 32)]
    times[80, 32] = [1.0, 1.3]
    assert calibrate_large_rows_blas(packed) is False
    assert calibrate_large_rows_blas([]) is False


def test_weights_oneDNN_cannot_run_stay_unpacked() -> None:
    assert pack_weight(torch.randn(8, 4, dtype=torch.float64)) is None
    assert pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.randn(8)) is None
    layer = Linear(4, 8, dtype=torch.float64)
    assert layer.pack_weights() == [] and layer.packed is None
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_onednn
@pytest.mark.parametrize("name", ["llama_ckpt", "qwen2_ckpt"])
def test_model_packs_every_linear_and_its_lm_head(request: pytest.FixtureRequest, name: str):
    """A loaded CPU model runs all its matmuls, the LM head included, on packed weights
    (Llama's head is its own matrix, the Qwen2 checkpoint's is tied to the embeddings)."""
    ckpt: Checkpoint = request.getfixturevalue(name)
    model = load_model(ckpt.path, torch.float32, "cpu")
    tied = model.config.tie_word_embeddings
    assert tied == (name == "qwen2_ckpt")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    panels = torch.float32 in kernels.linear_dtypes()  # the panel kernel where it runs
    assert all(m.packed.panels == panels for m in linears)
    assert (model.tied_head_packed is not None) == tied
    assert len(pack_weights(model)) == len(linears) + int(tied)  # idempotent: packs afresh
    hidden = torch.randn(5, model.config.hidden_size)
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    expected = F.linear(hidden.double(), head.double())
    got = model.compute_logits(hidden)
    assert (got.double() - expected).abs().max().item() < 1e-4
    # The speculation policy prices the panel kernel's row tiles (`SpecPolicy(row_tiles=)`).
    tiles = model.row_tiles()
    assert (tiles is not None) == panels
    if panels:
        size = 6 if kernels.linear_vector_bits() == 256 else 28
        assert [tiles(rows) for rows in (1, size, size + 1, 3 * size)] == [1, 1, 2, 3]


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_row_tiles_are_the_kernels_passes(dtype: torch.dtype) -> None:
    """Tiles of 28 rows with AVX-512, 6 with AVX2, 16 on AMX tiles (bfloat16 where K is a
    multiple of 32)."""
    size = 6 if kernels.linear_vector_bits() == 256 else 28
    amx = dtype == torch.bfloat16 and kernels.linear_amx_min_rows() > 0
    for rows in (1, 2, 6, 7, 16, 17, 28, 29, 57, 100):
        expected = -(-rows // (16 if amx else size))
        assert kernels.linear_row_tiles(rows, 576, dtype) == expected, rows
    assert kernels.linear_row_tiles(29, 37, dtype) == -(-29 // size)  # K not on AMX tiles


@needs_onednn
def test_moving_casting_or_reloading_packs_the_new_weight() -> None:
    """A packed copy never outlives its weight: `.to()` and `load_state_dict` pack again."""
    layer = Linear(16, 8)
    assert len(layer.pack_weights()) == 1
    x = torch.randn(3, 16)
    new_weight = torch.randn(8, 16)
    layer.load_state_dict({"weight": new_weight, "bias": torch.zeros(8)})
    torch.testing.assert_close(layer(x), F.linear(x, new_weight), atol=1e-5, rtol=1e-5)
    layer.to(torch.float64)  # oneDNN cannot run float64: back to F.linear
    assert layer.packed is None
    assert torch.equal(layer(x.double()), F.linear(x.double(), layer.weight, layer.bias))


@needs_onednn
def test_input_of_another_dtype_gets_f_linears_error() -> None:
    layer = Linear(16, 8)
    layer.pack_weights()
    with pytest.raises(RuntimeError, match="dtype"):
        layer(torch.randn(3, 16, dtype=torch.float64))


@needs_onednn
def test_casting_a_model_repacks_its_tied_head(qwen2_ckpt: Checkpoint) -> None:
    model = load_model(qwen2_ckpt.path, torch.float32, "cpu")
    assert model.tied_head_packed is not None
    model.to(torch.float64)
    assert model.tied_head_packed is None
    hidden = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
    assert torch.equal(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens.weight))


@needs_onednn
def test_inputs_below_min_rows_take_f_linear() -> None:
    """Below its `min_rows` a packed layer is exactly `F.linear`; from it on, the packed GEMM
    (which sums in another order, so it is close but not bitwise equal here)."""
    g = torch.Generator().manual_seed(3)
    layer = Linear(576, 960)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=g) / 24)
    (packed,) = layer.pack_weights()
    packed.min_rows = 4
    calls = []
    original = linear_module.PackedWeight.__call__

    def spy(self, x, bias):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return original(self, x, bias)

    linear_module.PackedWeight.__call__ = spy  # type: ignore[method-assign]
    try:
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 576, generator=g)
            got = layer(x)
            if rows < 4:
                assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(
                got, F.linear(x, layer.weight, layer.bias), atol=2e-5, rtol=1e-4
            )
    finally:
        linear_module.PackedWeight.__call__ = original  # type: ignore[method-assign]
    assert calls == [4, 9]
    layer.to(torch.float32)  # repacking keeps the calibrated threshold
    assert layer.packed is not None and layer.packed is not packed and layer.packed.min_rows == 4


@needs_onednn
def test_calibration_picks_a_candidate_and_large_models_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = nn.Sequential(*(Linear(256, 1024) for _ in range(4)))
    packed = pack_weights(layers)  # 4 MB: under the calibration size, packed from 1 row
    assert [p.min_rows for p in packed] == [1] * 4
    rng = torch.get_rng_state()
    assert calibrate_min_rows(packed, (1, 2, 4)) in (1, 2, 4, 8)
    if any(p.panels for p in packed):  # only panels run the fused decode step: from one row
        assert calibrate_min_rows(packed, (2, 4)) == 1
    assert torch.equal(torch.get_rng_state(), rng)  # loading a model draws no random numbers
    monkeypatch.setattr(linear_module, "CALIBRATE_MIN_BYTES", 1)
    monkeypatch.setattr(linear_module, "calibrate_min_rows", lambda packed: 6)
    assert [p.min_rows for p in pack_weights(layers)] == [6] * 4
    assert all(m.packed is not None and m.packed.min_rows == 6 for m in layers)


@dataclass
class FakeCalibration:
    """Stands in for `calibrate_min_rows`: counts calls (weights per call) and returns the next
    of `results`, so a cached value and a measured one are told apart."""

    results: list[int]
    calls: list[int] = field(default_factory=list)
    onednn_rows: int = 32  # what the hand-over's calibration (`hand_over`) answers
    large_rows_blas: bool = True  # what the large rows' calibration (`blas`) answers
    blas_calls: int = 0

    def __call__(self, packed: list[PackedWeight]) -> int:
        self.calls.append(len(packed))
        return self.results[len(self.calls) - 1]

    def hand_over(self, packed: list[PackedWeight]) -> int:
        return self.onednn_rows

    def blas(self, packed: list[PackedWeight]) -> bool:
        self.blas_calls += 1
        return self.large_rows_blas


@pytest.fixture
def calibration(monkeypatch: pytest.MonkeyPatch) -> FakeCalibration:
    """Every model calibrates (no size threshold), with a `FakeCalibration`."""
    fake = FakeCalibration([])
    monkeypatch.setattr(linear_module, "CALIBRATE_MIN_BYTES", 1)
    monkeypatch.setattr(linear_module, "calibrate_min_rows", fake)
    monkeypatch.setattr(linear_module, "calibrate_onednn_rows", fake.hand_over)
    monkeypatch.setattr(linear_module, "calibrate_large_rows_blas", fake.blas)
    return fake


@pytest.fixture
def linear_log(monkeypatch: pytest.MonkeyPatch) -> list[CapturedCall]:
    """The events `linear` logs, recorded instead of printed."""
    logger = structlog.testing.CapturingLogger()
    monkeypatch.setattr(linear_module, "log", logger)
    return logger.calls


def _model(*shapes: tuple[int, int]) -> nn.Module:
    return nn.Sequential(*(Linear(k, n) for n, k in shapes))


def _min_rows(module: nn.Module) -> list[int]:
    return [p.min_rows for p in pack_weights(module)]


def _events(calls: list[CapturedCall]) -> list[str]:
    return [call.args[0] for call in calls]


@needs_onednn
def test_calibration_is_logged_and_cached(calibration, linear_log, private_cache) -> None:
    """The first pack measures (logged as it starts and ends) and caches; a second pack of the
    same shapes on the same machine reads the cache and measures nothing."""
    calibration.results[:] = [6]
    assert _min_rows(_model((48, 32), (32, 48))) == [6, 6]
    assert _events(linear_log) == ["linear.calibrating", "linear.packed"]
    assert linear_log[0].kwargs["weights"] == 2
    assert _min_rows(_model((48, 32), (32, 48))) == [6, 6]
    assert calibration.calls == [2]
    assert _events(linear_log)[2:] == ["linear.calibration_cached"]
    assert linear_log[2].kwargs["packed_from_rows"] == 6
    assert linear_log[1].kwargs["onednn_from_rows"] == linear_log[2].kwargs["onednn_from_rows"]
    assert linear_log[2].kwargs["onednn_from_rows"] == 32
    packed = pack_weights(_model((48, 32), (32, 48)))  # cached
    assert [p.onednn_rows for p in packed] == [
        32 if p.large_rows_onednn else linear_module.PANEL_MAX_ROWS for p in packed
    ]
    (entry,) = json.loads((private_cache / "linear_calibration.json").read_text()).values()
    assert entry["min_rows"] == 6 and entry["onednn_rows"] == 32
    # A hand-over below PANEL_MAX_ROWS gives large rows a blocked copy: no BLAS to choose.
    assert entry["large_rows_blas"] is False and calibration.blas_calls == 0
    assert entry["threads"] == torch.get_num_threads()
    assert entry["cpu"] == kernels.cpu_model()


@needs_onednn
def test_the_large_rows_gemm_is_calibrated_and_cached(
    calibration, linear_log, private_cache
) -> None:
    """Where the hand-over stays at PANEL_MAX_ROWS, which library GEMM runs float32 prompt
    chunks is measured once, logged, cached and given to every packed weight."""
    calibration.results[:] = [6]
    calibration.onednn_rows = linear_module.PANEL_MAX_ROWS
    packed = pack_weights(_model((48, 32), (32, 48)))
    assert [p.large_rows_blas for p in packed] == [True, True]
    assert linear_log[1].kwargs["large_rows_gemm"] == "blas"
    packed = pack_weights(_model((48, 32), (32, 48)))  # cached
    assert [p.large_rows_blas for p in packed] == [True, True]
    assert linear_log[2].kwargs["large_rows_gemm"] == "blas"
    assert calibration.calls == [2] and calibration.blas_calls == 1
    (entry,) = json.loads((private_cache / "linear_calibration.json").read_text()).values()
    assert entry["large_rows_blas"] is True


@needs_onednn
def test_calibration_cache_is_per_shape_and_thread_count(calibration) -> None:
    calibration.results[:] = [6, 3, 5]
    assert _min_rows(_model((48, 32))) == [6]
    assert _min_rows(_model((64, 32))) == [3]  # other shapes: measured
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert _min_rows(_model((48, 32))) == [5]  # another thread count: measured
    finally:
        torch.set_num_threads(threads)
    assert _min_rows(_model((48, 32))) == [6]
    assert _min_rows(_model((64, 32))) == [3]
    assert calibration.calls == [1, 1, 1]


# How the cache file is spoiled, and how many `linear.calibration_cache_ignored` events that
# gives (an entry that is not a row count is skipped quietly).
CORRUPTIONS: dict[str, tuple[Callable[[str], str], int]] = {
    "not json": (lambda text: text[: len(text) // 2], 1),
    "a list": (lambda text: "[1, 2]", 1),
    "min_rows a string": (lambda text: text.replace('"min_rows": 6', '"min_rows": "6"'), 0),
    "min_rows zero": (lambda text: text.replace('"min_rows": 6', '"min_rows": 0'), 0),
    "no hand-over (an older entry)": (lambda text: text.replace('"onednn_rows"', '"x"'), 0),
    "no large rows' GEMM (an older entry)": (
        lambda text: text.replace('"large_rows_blas"', '"x"'),
        0,
    ),
}


@needs_onednn
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_calibration_cache_is_measured_again_and_rewritten(
    calibration, linear_log, private_cache, corruption: str
) -> None:
    calibration.results[:] = [6, 4, 4]
    path = private_cache / "linear_calibration.json"
    assert _min_rows(_model((48, 32))) == [6]
    spoil, ignored = CORRUPTIONS[corruption]
    corrupt = spoil(path.read_text())
    assert corrupt != path.read_text()
    path.write_text(corrupt)
    assert _min_rows(_model((48, 32))) == [4]
    assert _min_rows(_model((48, 32))) == [4]  # the rewritten cache
    assert calibration.calls == [1, 1]
    assert _events(linear_log).count("linear.calibration_cache_ignored") == ignored


@needs_onednn
def test_an_unwritable_calibration_cache_does_not_fail_packing(
    calibration, linear_log, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    calibration.results[:] = [6, 4]
    assert _min_rows(_model((48, 32))) == [6]
    assert _min_rows(_model((48, 32))) == [4]  # nothing cached: measured again
    assert _events(linear_log).count("linear.calibration_cache_unwritable") == 2


@needs_onednn
def test_a_calibration_made_while_other_processes_held_the_cores_is_not_cached(
    calibration, linear_log, private_cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A calibration whose threads got too little of the cores (here one that waits instead of
    computing, as a thread kept off its core does) is used but not cached: the next start
    measures again. One that kept its thread busy is cached."""
    monkeypatch.setattr(linear_module, "MIN_CALIBRATION_CPU_SHARE", 0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        waiting = FakeCalibration([6, 4])
        monkeypatch.setattr(linear_module, "calibrate_min_rows", _timed(waiting, busy=False))
        assert _min_rows(_model((48, 32))) == [6]
        assert _min_rows(_model((48, 32))) == [4]  # measured again
        assert not (private_cache / "linear_calibration.json").exists()
        refused = [c for c in linear_log if c.args[0] == "linear.calibration_not_cached"]
        assert len(refused) == 2 and refused[0].kwargs["cpu_share"] < 0.5
        working = FakeCalibration([5, 3])
        monkeypatch.setattr(linear_module, "calibrate_min_rows", _timed(working, busy=True))
        assert _min_rows(_model((48, 32))) == [5]
        assert _min_rows(_model((48, 32))) == [5]  # cached
        assert working.calls == [1]
    finally:
        torch.set_num_threads(threads)


def _timed(fake: FakeCalibration, busy: bool) -> Callable[[list[PackedWeight]], int]:
    """`fake`, taking 0.3 s (judged calibrations take at least MIN_JUDGED_CALIBRATION_S) either
    computing on this thread or waiting."""

    def calibrate(packed: list[PackedWeight]) -> int:
        end = time.perf_counter() + 0.3
        if busy:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(0.3)
        return fake(packed)

    return calibrate


def test_widened_bfloat16_weights_never_go_to_onednn() -> None:
    """Where the panel kernel widens bfloat16 (no bfloat16 arithmetic), oneDNN would emulate it:
    a bfloat16 weight then takes the panels at every row count, float32 ones keep oneDNN's
    hand-over."""
    if torch.bfloat16 not in kernels.linear_dtypes() or not kernels.linear_widens_bfloat16():
        pytest.skip("the panel kernel multiplies bfloat16 here, or does not run it")
    layer = Linear(64, 48, dtype=torch.bfloat16)
    (packed,) = layer.pack_weights()
    assert packed.panels and not packed.large_rows_onednn
    assert packed.runs_panels(4096)
    (float32,) = Linear(64, 48).pack_weights()
    assert float32.large_rows_onednn == torch.backends.mkldnn.is_available()
