"""Narrow panels (`worker/cpu/narrow_panels.py`, `csrc/linear.c`): a float32 weight made of exact
4-bit blocks (`d q + m`, as a GGUF Q4_1 tensor dequantizes), 8-bit ones (`d q`, Q8_0) or
bfloat16 values is found, laid out, and multiplied with the float32 panels' sums bit for bit,
alone and inside the fused decode step."""

from __future__ import annotations

import json

import pytest
import torch
from paged_driver import greedy_decode_logits

from specserve.shared.gguf_metadata import find_bundled_gguf
from specserve.worker.cpu import fused_decode, kernels, narrow_panels
from specserve.worker.cpu import linear as linear_module
from specserve.worker.cpu.linear import (
    Linear,
    PackedWeight,
    _calibration_key,
    calibrate_narrow_rows,
    pack_again,
    pack_weight,
)
from specserve.worker.gguf_loader import load_gguf
from specserve.worker.loader import load_model

pytestmark = pytest.mark.skipif(
    not kernels.linear_narrow_max_rows(4), reason="no block panels on this CPU (AVX-512, AVX2)"
)


def _avx2() -> bool:
    return kernels.linear_vector_bits() == 256


def _float32_tile_rows() -> int:
    """Rows a float32 tile holds: 28 with AVX-512, 6 with AVX2."""
    return 6 if _avx2() else 28


def _4bit_tiles(rows: int) -> int:
    """The 4-bit panels' tiles: of up to 24 rows with AVX-512; with AVX2 one whole tile up to 4
    rows, else half-panel tiles of up to 8."""
    if not _avx2():
        return -(-rows // 24)
    return 1 if rows <= 4 else -(-rows // 8)


def _blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (d, m) float16 `[n, k/32]` and q `[n, k]` with 0 and 15 in every block (as a
    Q4_1 quantizer writes them: the least value at q = 0, the greatest at 15)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen, dtype=torch.uint8)
    q[..., 3], q[..., 17] = 0, 15
    return d, m, q.view(n, k)


def _dequantized(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The float32 weight, as GGUF's Q4_1 dequantizes: (d q) + m in float32."""
    return d.float().repeat_interleave(32, 1) * q.float() + m.float().repeat_interleave(32, 1)


def test_the_layout_is_the_kernels() -> None:
    """17 rows (a padded second panel) of depth 64: per panel and block, d and m as float16,
    then byte c of pair j = q(2j, c) | q(2j + 1, c) << 4; padded rows all zeros."""
    d, m, q = _blocks(17, 64, seed=1)
    packed = narrow_panels.pack_q4(_dequantized(d, m, q))
    assert packed is not None and packed.dtype == torch.uint8
    assert packed.numel() == kernels.narrow_panels_bytes(4, 17, 64) == 2 * 2 * 320
    expected: list[int] = []
    for panel in range(2):
        for block in range(2):
            rows = [panel * 16 + c for c in range(16)]
            for table in (d, m):
                values = [float(table[r, block]) if r < 17 else 0.0 for r in rows]
                expected += torch.tensor(values, dtype=torch.float16).view(torch.uint8).tolist()
            for j in range(16):
                for r in rows:
                    lo = int(q[r, block * 32 + 2 * j]) if r < 17 else 0
                    hi = int(q[r, block * 32 + 2 * j + 1]) if r < 17 else 0
                    expected.append(lo | hi << 4)
    assert packed.tolist() == expected


def test_4bit_row_tiles_are_the_kernels_passes() -> None:
    """The 4-bit tiles up to the most rows the 4-bit panels take, the float32 panels' tiles
    beyond, and where K is not whole blocks (the speculation policy prices them)."""
    most, f32_tile = kernels.linear_narrow_max_rows(4), _float32_tile_rows()
    for rows in (1, 4, 5, 8, 9, 16, 17, 24, 25, 48, 49, 64):
        want = _4bit_tiles(rows) if rows <= most else -(-rows // f32_tile)
        assert kernels.linear_row_tiles(rows, 576, torch.float32, bits=4) == want, rows
    assert kernels.linear_row_tiles(25, 48, torch.float32, bits=4) == -(-25 // f32_tile)


def _refuses_what_is_not_blocks(pack, exact: torch.Tensor) -> None:
    """`pack` takes the exact `[32, 64]` weight and refuses it nudged by one ulp past the probe
    rows, random values, a depth of partial blocks, bfloat16 and a NaN."""
    assert pack(exact) is not None
    nudged = exact.clone()
    nudged[20, 40] = torch.nextafter(nudged[20, 40], torch.tensor(1.0))  # past the probe rows
    assert pack(nudged) is None
    assert pack(torch.randn(32, 64)) is None
    assert pack(exact[:, :48]) is None  # not whole blocks
    assert pack(exact.to(torch.bfloat16)) is None
    with_nan = exact.clone()
    with_nan[0, 0] = float("nan")
    assert pack(with_nan) is None


def test_weights_not_made_of_4bit_blocks_get_none() -> None:
    _refuses_what_is_not_blocks(narrow_panels.pack_q4, _dequantized(*_blocks(32, 64, seed=3)))
    constant = torch.full((16, 32), 0.25)  # d = 0: every value m
    assert narrow_panels.pack_q4(constant) is not None


def test_panel_linear_refuses_4bit_panels_that_do_not_fit() -> None:
    weight = _dequantized(*_blocks(32, 64, seed=4))
    q4, panels = narrow_panels.pack_q4(weight), kernels.pack_panels(weight)
    assert q4 is not None
    with pytest.raises(ValueError, match="4-bit panels"):
        kernels.panel_linear(torch.randn(2, 64), panels, None, 32, q4[:-1], 4)
    with pytest.raises(ValueError, match="4-bit panels"):
        bf16 = kernels.pack_panels(weight.to(torch.bfloat16))
        kernels.panel_linear(torch.randn(2, 64).to(torch.bfloat16), bf16, None, 32, q4, 4)


def test_the_bundled_models_layers_are_found_as_4bit_blocks() -> None:
    """SmolLM2-135M's GGUF holds its layers as Q4_1 (the embedding as Q8_0): every linear
    weight of a layer, dequantized as the loader does, is found whole."""
    _, state = load_gguf(find_bundled_gguf())
    layer = {name: w for name, w in state.items() if name.startswith("model.layers.0.")}
    linears = [w for name, w in layer.items() if name.endswith("proj.weight")]
    assert len(linears) == 7
    assert all(narrow_panels.pack_q4(w) is not None for w in linears)
    assert narrow_panels.pack_q4(state["model.embed_tokens.weight"][:64]) is None


def test_a_calibration_tells_4bit_weights_from_float32_ones() -> None:
    """The hand-over's cached calibration is keyed by whether weights have 4-bit panels (the
    panels it times read them): two models of the same shapes, one of 4-bit blocks, do not
    share an entry."""
    gen = torch.Generator().manual_seed(6)
    four_bit = pack_weight(narrow_panels.round_to_q4_blocks(torch.randn(64, 64, generator=gen)))
    plain = pack_weight(torch.randn(64, 64, generator=gen))
    assert four_bit is not None and plain is not None
    assert four_bit.bits == 4 and plain.narrow is None
    assert _calibration_key([four_bit])[0] != _calibration_key([plain])[0]


# --- the row limits, calibrated per machine and kind -----------------------------------------


def _q8_weight(n: int = 64, k: int = 96) -> PackedWeight:
    weight = narrow_panels.round_to_q8_blocks(
        torch.randn(n, k, generator=torch.Generator().manual_seed(11))
    )
    packed = pack_weight(weight)
    assert packed is not None and packed.narrow is not None and packed.bits == 8
    assert packed.narrow_rows == kernels.linear_narrow_max_rows(8)
    return packed


def _q4_weight(n: int = 64, k: int = 96) -> PackedWeight:
    d, m, q = _blocks(n, k, seed=4)
    packed = pack_weight(_dequantized(d, m, q))
    assert packed is not None and packed.narrow is not None and packed.bits == 4
    assert packed.narrow_rows == kernels.linear_narrow_max_rows(4)
    return packed


def _timings(q4_loses_from: int | None, lost: float = 0.9):
    """Stands in for `_best_passes` (machine timings): the 4-bit pass (first) takes 1.0, the
    float32 pass 1.5 below `q4_loses_from` rows and `lost` from there on."""

    def best(*passes):
        narrow_calls, float32_calls = passes
        rows = narrow_calls[0].args[0].shape[0]
        assert narrow_calls[0].args[4] is not None and narrow_calls[0].args[5] in (4, 8, 16)
        assert len(float32_calls[0].args) == 4
        behind = q4_loses_from is not None and rows >= q4_loses_from
        return [1.0, lost if behind else 1.5]

    return best


@pytest.mark.parametrize(
    ("loses_from", "expected"), [(32, 24), (16, 12), (6, 4), (4, 2), (64, 48), (None, None)]
)
def test_the_narrow_row_limit_is_the_last_row_count_where_they_won(
    monkeypatch: pytest.MonkeyPatch, loses_from: int | None, expected: int | None
) -> None:
    """`calibrate_narrow_rows`: the candidate before the first where the float32 panels take
    at most `NARROW_MARGIN` of the narrow panels' time, half the first candidate where that is
    the first, the kernel's limit for the kind where the narrow panels always win (or where no
    weight has them, timing nothing)."""
    monkeypatch.setattr(linear_module, "_best_passes", _timings(loses_from))
    b16 = pack_weight(torch.randn(64, 96).to(torch.bfloat16).float())
    assert b16 is not None and b16.bits == 16
    for bits, weight in ((4, _q4_weight()), (8, _q8_weight()), (16, b16)):
        most = kernels.linear_narrow_max_rows(bits)
        candidates = [r for r in linear_module.NARROW_CALIBRATION_ROWS if r <= most]
        want = most if expected is None else expected
        if loses_from is not None and loses_from not in candidates:
            want = most  # an AVX2 kernel's blocks stop at 16 rows: never reached
        assert calibrate_narrow_rows([weight], bits) == want, bits
    plain = pack_weight(torch.randn(64, 96))
    assert plain is not None and plain.narrow is None
    monkeypatch.setattr(linear_module, "_best_passes", None)  # nothing timed
    most = kernels.linear_narrow_max_rows(4)
    assert calibrate_narrow_rows([plain], 4) == most
    assert calibrate_narrow_rows([_q4_weight()], 8) == most  # no 8-bit panels among them


def test_narrow_panels_that_tie_with_the_float32_ones_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within `NARROW_MARGIN` of the float32 panels (a tie, whose winner is the timing's noise)
    the narrow panels stay: they read a fraction of the bytes. Beyond it they end."""
    most = kernels.linear_narrow_max_rows(4)
    tie = (1.0 + linear_module.NARROW_MARGIN) / 2
    monkeypatch.setattr(linear_module, "_best_passes", _timings(6, lost=tie))
    assert calibrate_narrow_rows([_q4_weight()], 4) == most
    behind = linear_module.NARROW_MARGIN - 0.01
    monkeypatch.setattr(linear_module, "_best_passes", _timings(6, lost=behind))
    assert calibrate_narrow_rows([_q4_weight()], 4) == 4


def test_inputs_beyond_the_4bit_row_limit_read_the_float32_panels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight whose limit is 4 rows passes its 4-bit panels to the kernel for 1-4 rows and
    not for 5 (its row tiles then the float32 tiles'; the fused decode step's table likewise),
    with the same outputs; packing it again keeps the limit."""
    packed = _q4_weight()
    packed.narrow_rows = 4
    given: list[bool] = []
    panel_linear = kernels.panel_linear

    def spy(x, tensor, bias, n, narrow=None, bits=0):
        given.append(narrow is not None)
        return panel_linear(x, tensor, bias, n, narrow, bits)

    monkeypatch.setattr(kernels, "panel_linear", spy)
    x = torch.randn(5, 96)
    for rows in (1, 4, 5):
        assert torch.equal(packed(x[:rows], None), panel_linear(x[:rows], packed.tensor, None, 64))
    assert given == [True, True, False]
    assert packed.row_tiles(4) == _4bit_tiles(4)
    assert packed.row_tiles(5) == kernels.linear_row_tiles(5, 96, torch.float32)
    layer = Linear(96, 64, bias=False)
    layer.packed = packed
    assert fused_decode._linear_addresses(layer, torch.float32, 4, 96, 64)[2] != 0
    assert fused_decode._linear_addresses(layer, torch.float32, 5, 96, 64)[2] == 0
    again = pack_again(packed, packed.weight)
    assert again is not None and again.bits == 4 and again.narrow_rows == 4


def test_a_calibrated_4bit_row_limit_is_cached_and_applied(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A model that calibrates gets the measured 4-bit limit on every weight with 4-bit panels
    (before the oneDNN hand-over is timed), and the cache holds it: the next start of the same
    model measures nothing."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_module, "CALIBRATE_MIN_BYTES", 1)
    monkeypatch.setattr(linear_module, "calibrate_min_rows", lambda packed: 1)
    limits_at_hand_over: list[list[tuple[int, int]]] = []

    def hand_over(packed):  # timed on the panels as they will run: the limits already set
        limits_at_hand_over.append([(p.bits, p.narrow_rows) for p in packed])
        return 256

    monkeypatch.setattr(linear_module, "calibrate_onednn_rows", hand_over)
    calls: list[tuple[int, int]] = []

    def calibrate(packed, bits):
        calls.append((len(packed), bits))
        return 3 if bits == 4 else 5

    monkeypatch.setattr(linear_module, "calibrate_narrow_rows", calibrate)
    d, m, q = _blocks(64, 96, seed=8)

    def model() -> torch.nn.Module:
        layers = torch.nn.Sequential(Linear(96, 64, bias=False), Linear(96, 64, bias=False))
        with torch.no_grad():
            layers[0].weight.copy_(_dequantized(d, m, q))
            layers[1].weight.copy_(eight_bit)
        return layers

    eight_bit = narrow_panels.round_to_q8_blocks(torch.randn(64, 96))
    for _ in range(2):
        packed = linear_module.pack_weights(model())
        assert [(p.bits, p.narrow_rows) for p in packed] == [(4, 3), (8, 5)]
    assert calls == [(2, 4), (2, 8), (2, 16)] and limits_at_hand_over == [[(4, 3), (8, 5)]]
    (entry,) = json.loads((tmp_path / "linear_calibration.json").read_text()).values()
    assert entry["narrow_rows"] == {"4": 3, "8": 5, "16": 5}


# --- 8-bit panels (Q8_0 blocks) ---------------------------------------------------------------


def _q8_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random d float16 `[n, k/32]` and q int8 `[n, k]` with -127 or 127 in every block (as a
    Q8_0 quantizer writes them: the greatest magnitude at 127), a -128 in some."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.001 + 0.0001).half()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
    q[..., 5] = 127 * (1 - 2 * torch.randint(0, 2, (n, k // 32), generator=gen, dtype=torch.int8))
    q[::3, :, 9] = -128
    return d, q.view(n, k)


def _q8_dequantized(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The float32 weight, as GGUF's Q8_0 dequantizes: d q in float32."""
    return d.float().repeat_interleave(32, 1) * q.float()


def test_the_8bit_layout_is_the_kernels() -> None:
    """17 rows (a padded second panel) of depth 64: per panel and block, d as float16, then
    byte c of step j = q(j, c); padded rows all zeros."""
    d, q = _q8_blocks(17, 64, seed=1)
    packed = narrow_panels.pack_q8(_q8_dequantized(d, q))
    assert packed is not None and packed.dtype == torch.uint8
    assert packed.numel() == kernels.narrow_panels_bytes(8, 17, 64) == 2 * 2 * 544
    expected: list[int] = []
    for panel in range(2):
        for block in range(2):
            rows = [panel * 16 + c for c in range(16)]
            values = [float(d[r, block]) if r < 17 else 0.0 for r in rows]
            expected += torch.tensor(values, dtype=torch.float16).view(torch.uint8).tolist()
            for j in range(32):
                expected += [int(q[r, block * 32 + j]) % 256 if r < 17 else 0 for r in rows]
    assert packed.tolist() == expected


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 96), (1000, 576), (64, 1536)])
def test_block_panels_give_the_float32_panels_sums_bit_for_bit(bits: int, n: int, k: int) -> None:
    """Row counts of one tile (1-24 with AVX-512; with AVX2 whole tiles of 1-4 rows and half
    tiles of 5-8), of several, the most the block panels take and one more (the float32 panels
    then run), with a bias and a column count that pads the last panel; the float32 panels
    zeroed where the block ones run, so that they must be what is read."""
    if bits == 4:
        weight = _dequantized(*_blocks(n, k, seed=n + k))
        blocks = narrow_panels.pack_q4(weight)
    else:
        weight = _q8_dequantized(*_q8_blocks(n, k, seed=n + k))
        blocks = narrow_panels.pack_q8(weight)
        assert narrow_panels.pack_q4(weight) is None
    assert blocks is not None
    panels = kernels.pack_panels(weight)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=gen)
    most = kernels.linear_narrow_max_rows(bits)
    for rows in [*range(1, 26), 33, 49, most, most + 1]:
        x = torch.randn(rows, k, generator=gen)
        want = kernels.panel_linear(x, panels, bias, n)
        read = torch.zeros_like(panels) if rows <= most else panels
        assert torch.equal(kernels.panel_linear(x, read, bias, n, blocks, bits), want), rows


def test_weights_not_made_of_8bit_blocks_get_none() -> None:
    exact = _q8_dequantized(*_q8_blocks(32, 64, seed=3))
    _refuses_what_is_not_blocks(narrow_panels.pack_q8, exact)
    negative_zero = exact.clone()
    negative_zero[0, :32] = -0.0  # d q is never -0.0
    assert narrow_panels.pack_q8(negative_zero) is None
    zeros = torch.zeros(16, 32)  # d = 0
    assert narrow_panels.pack_q8(zeros) is not None


def test_the_bundled_models_tied_head_is_found_as_8bit_blocks() -> None:
    """SmolLM2-135M's embedding (its tied LM head) is Q8_0 in the GGUF: dequantized as the
    loader does, it is found whole as 8-bit blocks, and its layers are not."""
    _, state = load_gguf(find_bundled_gguf())
    assert narrow_panels.pack_q8(state["model.embed_tokens.weight"]) is not None
    assert narrow_panels.pack_q8(state["model.layers.0.mlp.down_proj.weight"]) is None


def _to_bfloat16_values(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight rounded to bfloat16 values, kept in float32 (a bfloat16 checkpoint)."""
    return weight.to(torch.bfloat16).float()


@pytest.mark.parametrize(
    ("rounding", "bits"),
    [
        (narrow_panels.round_to_q4_blocks, 4),
        (narrow_panels.round_to_q8_blocks, 8),
        (_to_bfloat16_values, 16),
    ],
)
def test_decode_steps_on_narrow_panels_equal_the_float32_panels(
    llama_ckpt, monkeypatch: pytest.MonkeyPatch, rounding, bits: int
) -> None:
    """A model whose matrices (linear weights and tied head) are 4-bit or 8-bit blocks, or
    bfloat16 values: its fused decode steps read those narrow panels (their row tiles priced as
    the kernel makes them) and give the logits the float32 panels give, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # a team, split unevenly
    try:
        model = load_model(llama_ckpt.path, torch.float32)
        state = model.state_dict()
        narrow = {name: rounding(v) if v.dim() == 2 else v for name, v in state.items()}
        model.load_state_dict(narrow)  # packs the linear weights again
        model.pack_weights()  # a tied head is packed with the model
        linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed.bits == bits for m in linears)
        head = model._head_packed()
        assert head is not None and head.bits == bits
        tables = []
        layer_row = fused_decode._layer_row

        def spy(*args, **kwargs):
            row = layer_row(*args, **kwargs)
            tables.append(row)
            return row

        with monkeypatch.context() as patch:
            patch.setattr(fused_decode, "_layer_row", spy)
            on_narrow = greedy_decode_logits(model, [3, 11, 1, 17, 8], steps=6, seed=5)
        columns = ("qkv", "o", "gate_up", "down")
        assert tables and all(getattr(row, f"{c}_narrow") for row in tables for c in columns)
        assert all(getattr(row, f"{c}_bits") == bits for row in tables for c in columns)
        sizes, most = (1, 4, 5, 8, 9, 16, 24, 25), kernels.linear_narrow_max_rows(bits)
        assert [model.row_tiles()(rows) for rows in sizes] == [
            _4bit_tiles(rows) if bits < 16 and rows <= most else -(-rows // _float32_tile_rows())
            for rows in sizes
        ]
        monkeypatch.setattr(kernels, "linear_narrow_max_rows", lambda bits: 0)
        model.load_state_dict(narrow)  # packed again, without narrow panels
        model.pack_weights()
        assert all(m.packed.narrow is None for m in linears)
        assert model._head_packed().narrow is None
        on_float32 = greedy_decode_logits(model, [3, 11, 1, 17, 8], steps=6, seed=5)
    finally:
        torch.set_num_threads(threads)
    for step, (got, want) in enumerate(zip(on_narrow, on_float32, strict=True)):
        assert torch.equal(got, want), f"decode step {step} differs"


# --- 16-bit panels (bfloat16 values) --------------------------------------------------------


def test_the_16bit_layout_is_the_float32_panels_upper_halves() -> None:
    weight = _to_bfloat16_values(torch.randn(37, 40))
    b16 = narrow_panels.pack_b16(weight)
    assert b16 is not None and b16.numel() == kernels.narrow_panels_bytes(16, 37, 40) == 3 * 40 * 32
    upper = kernels.pack_panels(weight).view(torch.int32).bitwise_right_shift(16)
    assert torch.equal(b16.view(torch.int16).view(-1), upper.to(torch.int16).view(-1))


@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 90), (1000, 576)])
def test_16bit_panels_give_the_float32_panels_sums_bit_for_bit(n: int, k: int) -> None:
    """Row counts of one tile and of several, up to the panels' hand-over (no row limit of
    their own), with a bias, a depth that is not whole blocks and a padded last panel; the
    float32 panels zeroed, so that the 16-bit ones must be what is read."""
    gen = torch.Generator().manual_seed(n + k)
    weight = _to_bfloat16_values(torch.randn(n, k, generator=gen))
    b16 = narrow_panels.pack_b16(weight)
    assert b16 is not None and narrow_panels.pack(weight)[1] == 16
    panels, read = kernels.pack_panels(weight), torch.zeros(-(-n // 16), k, 16)
    bias = torch.randn(n, generator=gen)
    for rows in [*range(1, 31), 57, 64, 100]:
        x = torch.randn(rows, k, generator=gen)
        want = kernels.panel_linear(x, panels, bias, n)
        assert torch.equal(kernels.panel_linear(x, read, bias, n, b16, 16), want), rows


def test_weights_not_made_of_bfloat16_values_get_no_16bit_panels() -> None:
    weight = _to_bfloat16_values(torch.randn(40, 32))
    assert narrow_panels.pack_b16(weight) is not None
    nudged = weight.clone()
    nudged[30, 3] = torch.nextafter(nudged[30, 3], torch.tensor(9.0))  # past the probe rows
    assert narrow_panels.pack_b16(nudged) is None
    assert narrow_panels.pack_b16(weight.to(torch.bfloat16)) is None  # float32 weights only
    assert narrow_panels.pack(torch.randn(40, 32)) is None
    four_bit = narrow_panels.round_to_q4_blocks(torch.randn(16, 32))
    assert narrow_panels.pack(four_bit)[1] == 4  # the narrowest kind that holds it
