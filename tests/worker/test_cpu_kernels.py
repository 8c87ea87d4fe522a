"""The compiled CPU kernels: decode attention against the dense float64 reference and the SDPA
path it replaces, the fused norm/activation kernels against the PyTorch ops they replace, and
the fallback when the library cannot be built.

Tolerances against the float64 reference: float32 atol 2e-6, bfloat16 atol 1e-2 (the output
is rounded to bfloat16, |out| < 2 here); kernel vs SDPA path in float32: atol 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
from structlog.testing import CapturedCall
from test_linear import _assert_panel_result, _reference
from test_worker_attention import LONG_MIXED, MIXED, _run_case

from specserve.worker.cpu import kernels, narrow_panels, ops
from specserve.worker.models import RMSNorm

pytestmark = pytest.mark.skipif(
    kernels._compiler() is None, reason="no C compiler: the kernel cannot be built here"
)

# The multi-row kernel needs AVX-512, or AVX2 with FMA; elsewhere the torch backend keeps SDPA.
needs_multi_row_kernel = pytest.mark.skipif(
    not kernels.prefill_available(), reason="the multi-row kernel does not run on this CPU"
)

DECODES = [(1, 1, True), (1, 16, True), (1, 17, True), (1, 150, True), (1, 47, True)]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts kernel calls (batch size of each), so a test fails if attention bypassed it."""
    calls: list[int] = []
    real = kernels.paged_decode_attention

    def spy(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize(("block_size", "head_dim"), [(4, 8), (16, 64), (16, 128), (8, 48)])
def test_decodes_match_dense_reference(
    dtype: torch.dtype, window: int | None, block_size: int, head_dim: int, kernel_calls
) -> None:
    """Context lengths of one key, exactly one page, a page plus one and many pages; windows
    shorter and longer than the context; head dims of the unrolled (64, 128) and general paths."""
    out, expected = _run_case(DECODES, window, dtype, block_size, head_dim)
    assert kernel_calls == [len(DECODES)]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.fixture
def prefill_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts multi-row kernel calls (requests of each), so a test fails if attention bypassed
    it."""
    calls: list[int] = []
    real = kernels.paged_prefill_attention

    def spy(query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, *args) -> None:
        calls.append(table.shape[0])
        real(query, cache, table, *args)

    monkeypatch.setattr(kernels, "paged_prefill_attention", spy)
    return calls


# Prompt chunks of several 64-row tiles over long contexts, beside the mixed steps' short
# verification and draft blocks (one tile, one 8-row group) and decodes.
MULTI_ROW = [
    *LONG_MIXED,
    *MIXED,
    (150, 150, True),  # a fresh prompt of three tiles
    (130, 333, True),  # a later chunk: tiles over 203 keys of context, blocks across pages
    (70, 90, False),  # a long draft block over context
    (2, 2, True),
]


@needs_multi_row_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 3, 40, 100])
@pytest.mark.parametrize(("block_size", "head_dim"), [(4, 16), (16, 64), (16, 128), (8, 48)])
def test_multi_row_queries_match_dense_reference(
    dtype: torch.dtype,
    window: int | None,
    block_size: int,
    head_dim: int,
    prefill_calls,
    kernel_calls,
) -> None:
    """Every multi-row query of a step (prompt chunks fresh and after context, several tiles,
    verification and draft blocks, causal or not, windows that hide keys inside a tile and
    within a key block) goes through one kernel call; decodes through the decode kernel."""
    out, expected = _run_case(MULTI_ROW, window, dtype, block_size, head_dim)
    assert prefill_calls == [sum(q > 1 for q, _, _ in MULTI_ROW)]
    assert kernel_calls == [sum(q == 1 for q, _, _ in MULTI_ROW)]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_bfloat16_multi_row_queries_run_on_amx_tiles_where_the_cpu_has_them() -> None:
    """On a CPU with AMX tiles the dense-reference cases above (head dims 64 and 128) check the
    tiles' body; head dims 16 and 48 keep the vector body."""
    if "amx_bf16" not in kernels._cpu_signature().split():
        pytest.skip("no AMX tiles on this CPU")
    assert kernels.prefill_on_tiles(64, torch.bfloat16)
    assert kernels.prefill_on_tiles(128, torch.bfloat16)
    assert not kernels.prefill_on_tiles(48, torch.bfloat16)
    assert not kernels.prefill_on_tiles(64, torch.float32)


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory: pytest.TempPathFactory):
    """The library built without AVX-512 (`-mno-avx512f`), so that its AVX2 bodies run and
    are checked on an AVX-512 CPU too (on an AVX2-only CPU it is the usual build)."""
    if not {"avx2", "fma"} <= set(kernels._cpu_signature().split()):
        pytest.skip("no AVX2 with FMA on this CPU")
    tmp = tmp_path_factory.mktemp("avx2-kernels")
    target = tmp / "specserve_kernels-avx2.so"
    kernels._compile(kernels._compiler(), tmp, target, (*kernels.COMPILE_FLAGS, "-mno-avx512f"))
    return kernels.open_library(target)


@pytest.fixture(scope="module")
def widened_avx512_library(tmp_path_factory: pytest.TempPathFactory):
    """The library built without AVX512_BF16 (`-mno-avx512bf16`), so that its AVX-512 body
    widens bfloat16 as on CPUs without the instructions (on those it is the usual build)."""
    if "avx512f" not in kernels._cpu_signature().split():
        pytest.skip("no AVX-512 on this CPU")
    tmp = tmp_path_factory.mktemp("widened-avx512-kernels")
    target = tmp / "specserve_kernels-widened.so"
    flags = (*kernels.COMPILE_FLAGS, "-mno-avx512bf16")
    kernels._compile(kernels._compiler(), tmp, target, flags)
    return kernels.open_library(target)


PANEL_CASES = [(1, 50, 37), (3, 960, 576), (6, 960, 576), (17, 50, 37), (40, 960, 576)]


def _panel_case(rows: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _native_bf16_sums() -> dict[int, torch.Tensor]:
    """This CPU's own bfloat16 panel results (not on the tiles) by case, where it has AVX-512:
    vdpbf16ps with AVX512_BF16, else the pairs widened on 16 lanes; the AVX2 body accumulates
    each pair in the same order."""
    native = kernels.linear_dtypes()
    if torch.bfloat16 not in native or kernels.linear_vector_bits() != 512:
        return {}
    tiles_from = kernels.linear_amx_min_rows() or 1 << 30
    return {
        i: kernels.panel_linear(x, kernels.pack_panels(w), b, n)
        for i, (rows, n, k) in enumerate(PANEL_CASES)
        if rows < tiles_from
        for x, w, b in [_panel_case(rows, n, k, torch.bfloat16)]
    }


def test_avx2_bodies_match_the_references(avx2_library, monkeypatch, prefill_calls) -> None:
    """The AVX2 multi-row attention (float32 and bfloat16) against the dense reference, and
    the AVX2 panel kernel against float64: float32, and bfloat16 widened to float32 (bit for
    bit the AVX-512 body's sums where this CPU has one); its 4-bit panels against its
    float32 ones, and its 8-bit and 16-bit panels likewise."""
    native_bf16 = _native_bf16_sums()
    monkeypatch.setattr(kernels, "load", lambda: avx2_library)
    assert kernels.prefill_available()
    assert kernels.linear_dtypes() == {torch.float32, torch.bfloat16}
    assert kernels.linear_widens_bfloat16()
    for dtype, window, block_size, head_dim in [
        (torch.float32, None, 16, 64),
        (torch.float32, 3, 4, 16),
        (torch.bfloat16, 40, 8, 48),
    ]:
        prefill_calls.clear()
        out, expected = _run_case(MULTI_ROW, window, dtype, block_size, head_dim)
        assert prefill_calls == [sum(q > 1 for q, _, _ in MULTI_ROW)]
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    for i, (rows, n, k) in enumerate(PANEL_CASES):
        x, w, b = _panel_case(rows, n, k, torch.float32)
        got = kernels.panel_linear(x, kernels.pack_panels(w), b, n)
        torch.testing.assert_close(got, _reference(x, w, b).float(), atol=1e-5, rtol=1e-5)
        x, w, b = _panel_case(rows, n, k, torch.bfloat16)
        got = kernels.panel_linear(x, kernels.pack_panels(w), b, n)
        _assert_panel_result(got, _reference(x, w, b), torch.bfloat16)
        if i in native_bf16:
            assert torch.equal(got, native_bf16[i])
    # 4-bit panels (whole tiles up to 4 rows, half-panel tiles beyond, float32 panels beyond 16
    # rows): the float32 panels' sums bit for bit.
    # A last panel of 13 columns (both halves partial) with a bias, one of 5 without; the
    # float32 panels zeroed under the 4-bit ones where those run, so they must be what is read.
    g = torch.Generator().manual_seed(9)
    assert kernels.linear_narrow_max_rows(4) == 16
    for n, bias in [(45, torch.randn(45, generator=g)), (37, None)]:
        weight = narrow_panels.round_to_q4_blocks(torch.randn(n, 96, generator=g))
        q4, panels = narrow_panels.pack_q4(weight), kernels.pack_panels(weight)
        assert q4 is not None
        for rows in (1, 3, 4, 5, 8, 9, 13, 16, 17):
            x = torch.randn(rows, 96, generator=g)
            want = kernels.panel_linear(x, panels, bias, n)
            read = torch.zeros_like(panels) if rows <= 16 else panels
            assert torch.equal(kernels.panel_linear(x, read, bias, n, q4, 4), want), (n, rows)
        weight = narrow_panels.round_to_q8_blocks(torch.randn(n, 96, generator=g))
        q8, panels = narrow_panels.pack_q8(weight), kernels.pack_panels(weight)
        assert q8 is not None  # 8-bit panels, in the same tiles
        for rows in (1, 3, 4, 5, 8, 9, 13, 16, 17):
            x = torch.randn(rows, 96, generator=g)
            want = kernels.panel_linear(x, panels, bias, n)
            read = torch.zeros_like(panels) if rows <= 16 else panels
            assert torch.equal(kernels.panel_linear(x, read, bias, n, q8, 8), want), (n, rows)
        weight = weight.to(torch.bfloat16).float()  # 16-bit panels, in the float32 tiles
        b16, panels = narrow_panels.pack_b16(weight), kernels.pack_panels(weight)
        assert b16 is not None
        for rows in (1, 5, 6, 7, 13, 40):
            x = torch.randn(rows, 96, generator=g)
            want = kernels.panel_linear(x, panels, bias, n)
            read = torch.zeros_like(panels)
            assert torch.equal(kernels.panel_linear(x, read, bias, n, b16, 16), want), (n, rows)


def test_the_widened_avx512_bfloat16_body_sums_as_the_avx2_one(
    avx2_library, widened_avx512_library, monkeypatch
) -> None:
    """Without AVX512_BF16 the AVX-512 body widens each bfloat16 pair and accumulates it in the
    AVX2 body's order: the same outputs bit for bit, over one-row, multi-tile, odd-depth and
    padded cases."""
    outputs = {}
    for name, library in (("avx2", avx2_library), ("avx512", widened_avx512_library)):
        monkeypatch.setattr(kernels, "load", lambda library=library: library)
        assert kernels.linear_widens_bfloat16() and torch.bfloat16 in kernels.linear_dtypes()
        outputs[name] = [
            kernels.panel_linear(x, kernels.pack_panels(w), b, n)
            for rows, n, k in PANEL_CASES
            for x, w, b in [_panel_case(rows, n, k, torch.bfloat16)]
        ]
    assert kernels.linear_vector_bits() == 512
    for case, (got, want) in enumerate(zip(outputs["avx512"], outputs["avx2"], strict=True)):
        assert torch.equal(got, want), PANEL_CASES[case]


@needs_multi_row_kernel
def test_multi_row_kernel_matches_sdpa_path() -> None:
    kernel_out, _ = _run_case(MULTI_ROW, 40, torch.float32, 16, 64)
    sdpa_out, _ = _run_case(MULTI_ROW, 40, torch.float32, 16, 64, multi_row_kernel=False)
    torch.testing.assert_close(kernel_out, sdpa_out, atol=1e-6, rtol=0)


def test_multi_row_queries_the_kernel_cannot_run_use_sdpa(prefill_calls) -> None:
    """float64, and a head dim that is not whole 16-wide vectors, fall back to SDPA per layer."""
    out, expected = _run_case(MULTI_ROW, 3, torch.float64)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    out, expected = _run_case(MULTI_ROW, None, torch.float32, 4, 8)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)
    assert prefill_calls == []


def _prefill_inputs(seq_len: int, pages: list[int]) -> tuple[torch.Tensor, ...]:
    cache = torch.randn(4, 2, 4, 2, 16)
    query = torch.randn(3, 4, 16)
    table = torch.tensor([[0, 3, seq_len - 3, 0, seq_len, 1, 0, len(pages)]])
    return query, cache, table, torch.tensor(pages), torch.empty(3, 4, 16)


@needs_multi_row_kernel
def test_multi_row_pages_that_do_not_cover_the_keys_raise() -> None:
    """A page list shorter than the visible keys, or pages outside the cache, are refused (each
    KV head's item), never read past."""
    query, cache, table, pages, out = _prefill_inputs(6, [2])
    with pytest.raises(RuntimeError, match="failed for 2 work items"):
        kernels.paged_prefill_attention(query, cache, table, pages, None, 1.0, out)
    query, cache, table, pages, out = _prefill_inputs(6, [2, 8])  # block 4 of a 4-block cache
    with pytest.raises(RuntimeError, match="failed for 2 work items"):
        kernels.paged_prefill_attention(query, cache, table, pages, None, 1.0, out)


@needs_multi_row_kernel
def test_multi_row_inputs_that_do_not_fit_raise() -> None:
    query, cache, table, pages, out = _prefill_inputs(6, [2, 4])
    with pytest.raises(ValueError, match="outside the step's 3 rows"):
        kernels.paged_prefill_attention(
            query, cache, table + torch.tensor([1] + [0] * 7), pages, None, 1.0, out
        )
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_prefill_attention(query, cache, table, pages.int(), None, 1.0, out)
    with pytest.raises(ValueError, match="does not fit cache"):
        kernels.paged_prefill_attention(query[:, :, :8], cache, table, pages, None, 1.0, out)
    with pytest.raises(ValueError, match=r"queries must be \[R, 8\]"):
        kernels.paged_prefill_attention(query, cache, table[:, :7], pages, None, 1.0, out)


@pytest.mark.parametrize("window", [None, 3, 5])
def test_mixed_batch_decodes_use_kernel(window: int | None, kernel_calls) -> None:
    """Decode rows of a mixed step go through the kernel and land in their rows of the output
    (head dim 8: the multi-row queries stay on SDPA)."""
    out, expected = _run_case(MIXED, window, torch.float32)
    assert kernel_calls == [sum(q == 1 for q, _, _ in MIXED)]
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


def test_kernel_matches_sdpa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [(1, n, True) for n in (3, 31, 64, 200, 9)]
    kernel_out, _ = _run_case(specs, None, torch.float32, 16, 64)
    monkeypatch.setattr(kernels, "attention_supported", lambda *_: False)
    sdpa_out, _ = _run_case(specs, None, torch.float32, 16, 64)
    torch.testing.assert_close(kernel_out, sdpa_out, atol=1e-6, rtol=0)


def test_float64_keeps_sdpa(kernel_calls) -> None:
    out, expected = _run_case(DECODES, None, torch.float64)
    assert kernel_calls == []
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


def test_mismatched_shapes_raise() -> None:
    cache = torch.zeros(4, 2, 4, 2, 8)
    query = torch.zeros(1, 4, 16)  # head_dim 16 against a cache of 8
    pages = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not fit cache"):
        kernels.paged_decode_attention(
            query,
            cache,
            pages,
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            None,
            1.0,
        )


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """`load()` with an empty kernel cache, and the process's cached library restored after."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPECSERVE_KERNELS_DIR", raising=False)
    kernels.load.cache_clear()
    yield kernels.load
    kernels.load.cache_clear()


def test_builds_into_cache_dir(fresh_load, tmp_path) -> None:
    assert fresh_load() is not None
    (lib,) = (tmp_path / "kernels").glob("specserve_kernels-*.so")
    assert lib.stat().st_size > 0
    assert not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()]  # no leftover tmp


@pytest.fixture
def kernel_log(monkeypatch: pytest.MonkeyPatch) -> list[CapturedCall]:
    """The events `kernels` logs (method, event, fields), recorded instead of printed."""
    logger = structlog.testing.CapturingLogger()
    monkeypatch.setattr(kernels, "log", logger)
    return logger.calls


def test_without_compiler_falls_back_to_sdpa(
    fresh_load, monkeypatch: pytest.MonkeyPatch, kernel_calls, kernel_log, tmp_path
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert fresh_load() is None
    out, expected = _run_case(DECODES, None, torch.float32)
    assert kernel_calls == []
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)
    assert kernel_log == [
        CapturedCall(
            "warning",
            ("kernels.unavailable",),
            {
                "reason": f"no library for this CPU ({kernels.library_path().name}) in "
                f"{tmp_path / 'kernels'}, and it cannot be built: no C compiler "
                "(CC=/nonexistent/cc not found)"
            },
        )
    ]


def _specserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `specserve` command as a user runs it: the console script beside this Python."""
    script = Path(sys.executable).with_name("specserve")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "specserve.cli"]
    return subprocess.run(
        [*command, *argv], env=env, capture_output=True, text=True, timeout=300, check=False
    )


# A worker's view of a prebuilt kernels directory, in a process of its own (this one has its
# library loaded already): the library it loads, and two ops against torch's, bit for bit.
PREBUILT_CHECK = """
import json, torch
from specserve.worker.cpu import kernels
lib = kernels.load()
assert lib is not None, "the kernels did not load"
g = torch.Generator().manual_seed(0)
x, delta = torch.randn(7, 1000, generator=g), torch.randn(7, 1000, generator=g)
total, _ = kernels.add_rms_norm(x, delta, torch.ones(1000), 1e-6)
print(json.dumps({
    "library": lib._name,
    "argmax_equal": torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)),
    "sum_equal": torch.equal(total, x + delta),
}))
"""


def test_library_built_ahead_loads_from_a_read_only_dir_without_compiler(tmp_path) -> None:
    """`specserve kernels build --dir D`, as an image build runs it; then a process with D
    read-only and no compiler loads that library as it is, and its ops match torch's."""
    directory = tmp_path / "kernels"
    built = _specserve("kernels", "build", "--dir", str(directory))
    assert built.returncode == 0, built.stderr
    library = kernels.library_path(directory)
    assert built.stdout == f"{library}\n"
    assert list(directory.iterdir()) == [library]
    library.chmod(0o444)
    directory.chmod(0o555)
    env = {
        **os.environ,
        "SPECSERVE_KERNELS_DIR": str(directory),
        "SPECSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "CC": "/nonexistent/cc",
    }
    try:
        check = subprocess.run(
            [sys.executable, "-c", PREBUILT_CHECK],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert list(directory.iterdir()) == [library]  # nothing compiled, nothing written
    finally:
        directory.chmod(0o755)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == {
        "library": str(library),
        "argmax_equal": True,
        "sum_equal": True,
    }


def test_build_without_compiler_is_a_clear_error(tmp_path) -> None:
    directory = tmp_path / "kernels"
    result = _specserve(
        "kernels", "build", "--dir", str(directory), env={**os.environ, "CC": "/nonexistent/cc"}
    )
    assert result.returncode == 2
    assert result.stderr.endswith(
        "error: cannot build the CPU kernels: no C compiler (CC=/nonexistent/cc not found)\n"
    )
    assert result.stdout == ""
    assert not directory.exists()


def _unwritable_dir(tmp_path: Path, kind: str) -> Path:
    if kind == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes to a read-only directory anyway")
        directory = tmp_path / "kernels"
        directory.mkdir(mode=0o555)
        return directory
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "kernels"  # no directory can be made there


@pytest.mark.parametrize("kind", ["read-only", "under-a-file"])
def test_unwritable_empty_dir_falls_back_to_torch_with_one_event(
    fresh_load, kernel_log, monkeypatch: pytest.MonkeyPatch, tmp_path, kind: str
) -> None:
    directory = _unwritable_dir(tmp_path, kind)
    monkeypatch.setenv("SPECSERVE_KERNELS_DIR", str(directory))
    try:
        assert fresh_load() is None
        assert ops.argmax_rows(torch.randn(3, 40)) is None  # the caller keeps its torch op
        assert fresh_load() is None
    finally:
        if directory.exists():
            directory.chmod(0o755)
    assert [(call.method_name, call.args) for call in kernel_log] == [
        ("warning", ("kernels.unavailable",))
    ]
    reason = kernel_log[0].kwargs["reason"]
    strerror = "Permission denied" if kind == "read-only" else "Not a directory"
    assert reason == (
        f"no library for this CPU ({kernels.library_path().name}) in {directory}, and it "
        f"cannot be built: {directory} is not writable ({strerror}); `specserve kernels "
        "build` fills it ahead of time"
    )


def test_switched_off_by_environment(fresh_load, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    assert fresh_load() is None


# The fused element-wise kernels against the PyTorch paths they replace (kernels switched off).
# float32: atol 1e-6 (only the order of the sum of squares and the expf differ); bfloat16: the
# same roundings in the same places, so at most two bfloat16 steps apart (rtol 2**-6: silu(gate)
# one step off carries through the product with up), and the residual sum bitwise equal.
ROW_TOLERANCE = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
    torch.bfloat16: {"atol": 0, "rtol": 2**-6},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 64])  # 64 x 1536 runs the OpenMP-parallel branch
def test_add_and_norm_match_torch(dtype: torch.dtype, rows: int, monkeypatch) -> None:
    torch.manual_seed(rows)
    dim = 1536
    norm = RMSNorm(dim, 1e-5, dtype, "cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    wide = torch.randn(rows, 2 * dim).to(dtype)
    x = wide[:, :dim]  # strided rows, as a slice of a fused projection is
    delta = (torch.randn(rows, dim) * 3).to(dtype)
    calls = []
    real = kernels.add_rms_norm
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    fused_norm = norm(x)
    fused_sum, fused_sum_norm = norm.add_and_norm(x, delta)
    assert len(calls) == 2
    with monkeypatch.context() as torch_path:
        torch_path.setattr(kernels, "rows_supported", lambda *_: False)
        ref_norm = norm(x)
        ref_sum, ref_sum_norm = norm.add_and_norm(x, delta)
    assert torch.equal(fused_sum, ref_sum)
    torch.testing.assert_close(fused_norm, ref_norm, **ROW_TOLERANCE[dtype])
    torch.testing.assert_close(fused_sum_norm, ref_sum_norm, **ROW_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, **ROW_TOLERANCE[dtype])


def test_row_kernels_turn_down_what_they_cannot_run() -> None:
    x = torch.zeros(2, 8)
    assert kernels.rows_supported(x, x)
    assert not kernels.rows_supported(x.double())
    assert not kernels.rows_supported(x, x.to(torch.bfloat16))  # mixed dtypes
    assert not kernels.rows_supported(torch.zeros(2, 3, 8))  # 3-D (per-head q/k norms)
    assert not kernels.rows_supported(x.t())  # columns not contiguous


def test_pages_that_do_not_cover_the_keys_raise() -> None:
    """A page list shorter than the visible keys is refused (both KV heads), not read past."""
    cache = torch.randn(4, 2, 4, 2, 8)
    query = torch.randn(1, 4, 8)
    pages = torch.tensor([[2]])  # one page of 4 keys for a sequence of 6
    first, seq_lens = torch.zeros(1, dtype=torch.int64), torch.tensor([6])
    with pytest.raises(RuntimeError, match=r"failed for 2 \(request, head\) pairs"):
        kernels.paged_decode_attention(query, cache, pages, first, seq_lens, None, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_at_extreme_gates(dtype: torch.dtype) -> None:
    """Gates far below expf's overflow point give ~0, not NaN, in the vector and scalar code."""
    gate = torch.cat([torch.linspace(-1000, -80, 61), torch.tensor([0.0, 30.0, 100.0, 1e4])])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(dtype)
    out = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-30, **{"rtol": ROW_TOLERANCE[dtype]["rtol"]})


def test_row_and_index_inputs_of_the_wrong_kind_raise() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="add_rms_norm"):
        kernels.add_rms_norm(x, torch.zeros(1, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm"):
        kernels.add_rms_norm(x, None, torch.ones(4), 1e-6)
    cache, query = torch.zeros(4, 2, 4, 2, 8), torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode_attention(
            query,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            None,
            1.0,
        )


def test_a_broken_cached_library_is_rebuilt(fresh_load, tmp_path) -> None:
    """Checked in a new process: this one's loader would hand back the library it has mapped."""
    assert fresh_load() is not None
    (lib,) = (tmp_path / "kernels").glob("specserve_kernels-*.so")
    lib.unlink()  # a new file: this process still maps the old one
    lib.write_bytes(b"not a shared object")
    code = "from specserve.worker.cpu import kernels; assert kernels.load() is not None"
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert lib.read_bytes()[:4] == b"\x7fELF"


def _rope_case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, rows: int = 7):
    """qkv rows, RoPE tables at positions from 100 on, a cache and the K rows of `rows` slots."""
    torch.manual_seed(dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    positions = torch.arange(100, 100 + rows)
    cache = torch.zeros(8, 2, 4, kv_heads, dim, dtype=dtype)
    slots = torch.tensor([5, 6, 7, 8, 9, 10, 11, 13][:rows])
    return qkv, inv_freq, positions, cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (3, 1, 16), (2, 2, 128)])
def test_rope_and_kv_write_match_transformers_bit_for_bit(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """Each product and the sum rounded where transformers' `apply_rotary_pos_emb` rounds them
    (no fused multiply-add in float32), so q and the cached k are equal bit for bit; v is
    copied as it is."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from specserve.worker.kv_cache import kv_write_rows
    from specserve.worker.models import rope_cos_sin

    qkv, inv_freq, positions, cache, slots = _rope_case(dtype, heads, kv_heads, dim)
    rows = qkv.shape[0]
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    q = qkv[:, : heads * dim].view(rows, heads, dim).transpose(0, 1)[None]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    expected_q, expected_k = apply_rotary_pos_emb(
        q, k.transpose(0, 1)[None], emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]
    )
    out = qkv.clone()
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    k_rows, _ = kv_write_rows(slots, 4)
    kernels.rope_write_kv(out, heads, kv_heads, cos, sin, None, None, 0.0, cache, k_rows)
    assert torch.equal(out[:, : heads * dim].view(rows, heads, dim), expected_q[0].transpose(0, 1))
    flat = cache.view(8 * 2 * 4, kv_heads, dim)
    assert torch.equal(flat[k_rows], expected_k[0].transpose(0, 1))
    assert torch.equal(
        flat[k_rows + 4], qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    )
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[k_rows], written[k_rows + 4] = True, True
    assert not flat[~written].any()  # nothing else in the cache was touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norms_run_before_rope(dtype: torch.dtype, monkeypatch) -> None:
    """Qwen3's per-head q/k norms: the kernel against the decoder's PyTorch path."""
    from specserve.worker.kv_cache import kv_write_rows
    from specserve.worker.models import apply_rope, rope_cos_sin

    heads, kv_heads, dim = 4, 2, 32
    qkv, inv_freq, positions, cache, slots = _rope_case(dtype, heads, kv_heads, dim)
    rows = qkv.shape[0]
    q_norm, k_norm = RMSNorm(dim, 1e-6, dtype, "cpu"), RMSNorm(dim, 1e-6, dtype, "cpu")
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    k_rows, _ = kv_write_rows(slots, 4)
    out = qkv.clone()
    kernels.rope_write_kv(
        out, heads, kv_heads, cos, sin, q_norm.weight, k_norm.weight, 1e-6, cache, k_rows
    )
    q = q_norm(qkv[:, : heads * dim].view(rows, heads, dim))  # 3-D: the PyTorch path
    k = k_norm(qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim))
    # bfloat16: the PyTorch path's addcmul rounds RoPE's sum once where the kernel (like
    # transformers) rounds both products too; a sum that cancels then differs by a step of
    # its terms (|terms| < 4 here: 2**-6), however small the result.
    tolerance = ROW_TOLERANCE[dtype] if dtype == torch.float32 else {"atol": 2**-6, "rtol": 2**-7}
    torch.testing.assert_close(
        out[:, : heads * dim].view(rows, heads, dim), apply_rope(q, cos, sin), **tolerance
    )
    flat = cache.view(-1, kv_heads, dim)
    torch.testing.assert_close(flat[k_rows], apply_rope(k, cos, sin), **tolerance)


def test_rope_inputs_that_do_not_fit_raise() -> None:
    from specserve.worker.models import rope_cos_sin

    qkv, inv_freq, positions, cache, slots = _rope_case(torch.float32, 4, 2, 64)
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    with pytest.raises(ValueError, match="rope_write_kv"):  # 3 heads do not make up the row
        kernels.rope_write_kv(qkv, 3, 2, cos, sin, None, None, 0.0, cache, slots)
    with pytest.raises(ValueError, match="rope_write_kv"):  # tables for fewer rows
        kernels.rope_write_kv(qkv, 4, 2, cos[:3], sin[:3], None, None, 0.0, cache, slots)
    with pytest.raises(ValueError, match="int64"):
        kernels.rope_write_kv(qkv, 4, 2, cos, sin, None, None, 0.0, cache, slots.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cols", [1, 7, 256, 257, 49152])
def test_argmax_rows_match_torch(dtype: torch.dtype, cols: int) -> None:
    """Ties (first index wins, also across chunks of 256), infinities, NaN rows (torch picks the
    first NaN) and strided rows give exactly `argmax`'s indices."""
    torch.manual_seed(cols)
    wide = torch.randn(9, 2 * cols).to(dtype)
    x = wide[:, :cols]  # strided rows
    x[1] = 0.0  # all tied: index 0
    x[2, -1] = 1e4  # the last element
    if cols > 1:
        x[3, cols // 2] = x[3, cols - 1] = 1e4  # tied maxima in different chunks
        x[4, 0] = float("nan")
        x[4, -1] = float("nan")  # first NaN wins
        x[5, cols // 3] = float("inf")
        x[6] = float("-inf")
        x[6, -1] = -1e30
    expected = x.float().argmax(dim=-1)
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


def test_decode_tables_are_checked_by_name() -> None:
    """The library names the columns of `decode_layers`' tables as Python builds them; a
    column out of place or missing is refused, naming both lists."""
    lib = kernels.load()
    kernels.check_decode_tables(lib)
    layer = list(kernels.DecodeLayer._fields)
    swapped = [layer[0], layer[2], layer[1], *layer[3:]]  # qkv_bias before qkv
    with pytest.raises(RuntimeError) as error:
        kernels.check_decode_tables(lib, {**kernels.DECODE_TABLES, "layer": tuple(swapped)})
    assert str(error.value) == (
        f"decode_layers' layer table: the C library's columns {layer} are not Python's "
        f"{swapped} (csrc/decode_step.c and worker/cpu/kernels.py must name the same fields "
        "in the same order)"
    )


def test_a_library_missing_a_column_is_refused() -> None:
    class Library:  # a build whose group table lost its window column
        def decode_table_fields(self, number: int) -> bytes:
            fields = list(kernels.DECODE_TABLES.values())[number]
            kept = fields[:-1] if number == 1 else fields
            return ",".join(kept).encode() + b","

    group = list(kernels.DecodeGroup._fields)
    with pytest.raises(RuntimeError, match="group table") as error:
        kernels.check_decode_tables(Library())  # type: ignore[arg-type]
    assert f"columns {group[:-1]} are not Python's {group}" in str(error.value)
