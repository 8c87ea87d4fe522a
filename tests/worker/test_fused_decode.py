"""The fused decode step (`worker/cpu/fused_decode.py`, `csrc/decode_step.c`) against the
layer-by-layer path it replaces.

Both run the same kernels in the same order on the same rows, so every decode step's logits and
hidden states must be bit for bit equal (`torch.equal`), on every architecture the decoder
supports: Llama with Llama-3 RoPE scaling, Qwen2 (q/k/v biases, tied embeddings), Qwen3 (q/k
norms, head_dim != hidden / heads) and a Qwen3 sliding/full hybrid (two KV groups, window 8),
in float32 and bfloat16. Greedy output against transformers is pinned by
test_engine_oracle.py, whose decode steps take this path.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import prompts
from paged_driver import PagedDriver, greedy_decode_logits

from specserve.worker.attention.base import SequenceStep
from specserve.worker.cpu import fused_decode, kernels, linear
from specserve.worker.loader import load_model
from specserve.worker.model_runner import forward_step
from specserve.worker.models import DecoderModel

pytestmark = pytest.mark.skipif(
    torch.float32 not in kernels.linear_dtypes(),
    reason="the fused decode step needs the float32 panel kernel (AVX-512, or AVX2)",
)

CKPTS = ["llama_ckpt", "qwen2_ckpt", "qwen3_ckpt", "qwen3_hybrid_ckpt"]
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            torch.bfloat16 not in kernels.linear_dtypes(),
            reason="no AVX512_BF16 on this CPU",
        ),
    ),
]
PROMPT_LENGTHS = [3, 11, 1, 17, 8]  # ragged: some contexts cross a block, one starts at 1 token
# 21 requests: the linears run a full tile of 16 rows and a partial one, attention one item per
# request (fewer requests than twice the threads run one KV head per item instead).
MANY_PROMPT_LENGTHS = [3, 11, 1, 17, 8, 4, 9, 2, 13, 6, 5, 7, 10, 12, 16, 14, 15, 1, 2, 3, 20]
DECODE_STEPS = 12  # the hybrid's window of 8 slides past whole blocks


@pytest.fixture(autouse=True)
def three_threads():
    """The test session runs on one thread (conftest.py); the fused step's barriers, work
    sharing and atomics need a team, and an odd size splits work unevenly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fused_results(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each forward pass ran fused (True) or layer by layer (False)."""
    results: list[bool] = []
    real = fused_decode.decode_step

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        results.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode, "decode_step", spy)
    return results


def _layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_decode, "decode_step", lambda *args, **kwargs: None)


def _decode_run(
    model: DecoderModel, steps: int = DECODE_STEPS, lengths: list[int] = PROMPT_LENGTHS
) -> list[torch.Tensor]:
    """Prefill the prompts, then decode them together; the logits of every decode step."""
    return greedy_decode_logits(model, lengths, steps, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("name", "lengths"),
    [(name, PROMPT_LENGTHS) for name in CKPTS]
    + [(name, MANY_PROMPT_LENGTHS) for name in ("llama_ckpt", "qwen3_hybrid_ckpt")],
    ids=lambda v: f"{len(v)}-requests" if isinstance(v, list) else v,
)
def test_fused_steps_equal_the_layer_path_bit_for_bit(
    request, name: str, lengths: list[int], dtype: torch.dtype, fused_results, monkeypatch
) -> None:
    ckpt = request.getfixturevalue(name)
    model = load_model(ckpt.path, dtype)
    fused = _decode_run(model, lengths=lengths)
    assert fused_results == [False] + [True] * DECODE_STEPS  # the prefill is not a decode step
    with monkeypatch.context() as layers:
        _layer_by_layer(layers)
        reference = _decode_run(model, lengths=lengths)
    for step, (got, expected) in enumerate(zip(fused, reference, strict=True)):
        assert torch.equal(got, expected), f"decode step {step} differs"


def _one_decode_step(model: DecoderModel, aux_layers: tuple[int, ...]):
    """Hidden states and aux hidden states of the first decode step after a ragged prefill."""
    driver = PagedDriver(model, block_size=4)
    seqs = [driver.new_seq(p) for p in prompts(PROMPT_LENGTHS, seed=4)]
    driver.prefill(seqs)
    work = [(s, 1) for s in seqs]
    ids, positions, steps = [], [], []
    for seq, _ in work:
        driver.allocate(seq, seq.num_computed + 1)
        ids.append(seq.tokens[seq.num_computed])
        positions.append(seq.num_computed)
        steps.append(SequenceStep(1, seq.num_computed + 1, [list(t) for t in seq.block_tables]))
    meta = model.backend.build_metadata(steps, model.config.kv_groups, 4, "cpu")
    return forward_step(
        model, torch.tensor(ids), torch.tensor(positions), meta, driver.cache, aux_layers
    )


def test_aux_hidden_states_are_captured(qwen3_hybrid_ckpt, fused_results, monkeypatch) -> None:
    """The layers a drafter reads come out of the fused step as they do layer by layer."""
    model = load_model(qwen3_hybrid_ckpt.path, torch.float32)
    hidden, aux = _one_decode_step(model, (0, 2))
    assert fused_results[-1] is True
    _layer_by_layer(monkeypatch)
    ref_hidden, ref_aux = _one_decode_step(model, (0, 2))
    assert torch.equal(hidden, ref_hidden)
    assert len(aux) == 2 and all(torch.equal(a, b) for a, b in zip(aux, ref_aux, strict=True))
    assert not torch.equal(aux[0], aux[1])


def test_new_weights_are_picked_up(llama_ckpt, fused_results, monkeypatch) -> None:
    """Every step reads the weights the modules hold now: after a reload and a cast of the
    model, and after one norm's data was swapped behind its module's back."""
    model = load_model(llama_ckpt.path, torch.float32)
    first = _decode_run(model, steps=2)
    other = load_model(llama_ckpt.path, torch.float32)
    scaled = {name: value * 0.9 for name, value in other.state_dict().items()}
    other.load_state_dict(scaled)  # loading packs the linear weights again
    model.load_state_dict(scaled)
    reloaded = _decode_run(model, steps=2)
    model.to(torch.bfloat16)
    cast = _decode_run(model, steps=2)
    # bfloat16 steps are fused only where the bfloat16 panel kernel runs (AVX512_BF16).
    bf16_fused = torch.bfloat16 in kernels.linear_dtypes()
    assert all(fused_results[1:3] + fused_results[4:6])
    assert fused_results[7:9] == [bf16_fused, bf16_fused]
    assert not torch.equal(first[0], reloaded[0])
    _layer_by_layer(monkeypatch)
    assert all(
        torch.equal(a, b) for a, b in zip(reloaded, _decode_run(other, steps=2), strict=True)
    )
    other.to(torch.bfloat16)
    assert cast[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(cast, _decode_run(other, steps=2), strict=True))
    for target in (model, other):
        norm = target.layers[0].post_attention_layernorm
        norm.weight.data = norm.weight.detach() * 2  # new storage, same Parameter object
    monkeypatch.undo()
    swapped = _decode_run(model, steps=2)
    assert fused_results[-2:] == [bf16_fused, bf16_fused]
    assert not torch.equal(swapped[0], cast[0])
    _layer_by_layer(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(swapped, _decode_run(other, steps=2), strict=True))


def test_a_stack_is_kept_until_what_it_reads_changes(llama_ckpt, monkeypatch) -> None:
    """Steps of one row count on one KV cache share one table of addresses; a weight packed
    again, a norm's `.data` swapped, a norm given a new Parameter, a linear replaced by another
    module and a packed weight given another row limit each make a new one, and every step
    still equals the layer path."""
    model = load_model(llama_ckpt.path, torch.float32)
    other = load_model(llama_ckpt.path, torch.float32)  # the same weights, layer by layer
    drivers = {m: PagedDriver(m, block_size=4) for m in (model, other)}
    seqs = {m: [drivers[m].new_seq(p) for p in prompts(PROMPT_LENGTHS, seed=3)] for m in drivers}
    for m, driver in drivers.items():
        driver.prefill(seqs[m])
    made: list[fused_decode.LayerStack | None] = []
    real = fused_decode.LayerStack.of.__func__

    def counting(cls, *args, **kwargs):
        made.append(real(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(fused_decode.LayerStack, "of", classmethod(counting))

    def step(tables_made: int) -> None:
        before = len(made)
        fused = drivers[model].step([(s, 1) for s in seqs[model]])
        assert len(made) - before == tables_made
        with monkeypatch.context() as layers:
            _layer_by_layer(layers)
            reference = drivers[other].step([(s, 1) for s in seqs[other]])
        assert torch.equal(fused, reference)
        for m in drivers:
            for seq, row in zip(seqs[m], reference, strict=True):
                drivers[m]._append(seq, int(row.argmax()))

    step(1)
    step(0)
    step(0)
    for m in drivers:
        m.layers[1].mlp.down_proj.repack()  # a new packed copy
    step(1)
    for m in drivers:
        norm = m.layers[0].input_layernorm
        norm.weight.data = norm.weight.detach() * 1.5  # new storage, same Parameter
    step(1)
    for m in drivers:
        m.norm.weight = torch.nn.Parameter(m.norm.weight.detach() * 0.5)
    step(1)
    step(0)
    for m in drivers:
        mlp = m.layers[1].mlp
        down = linear.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
        down.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 1.25)
        down.pack_weights()
        mlp.down_proj = down  # a new module: the old one's panels may be freed
    step(1)
    packed = model.layers[0].attn.qkv_proj.packed
    assert packed is not None
    packed.min_rows = 64  # five rows now go layer by layer
    step(1)
    assert made[-1] is None
    step(0)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_steps_the_kernel_cannot_run_go_layer_by_layer(
    llama_ckpt, qwen3_hybrid_ckpt, fused_results
) -> None:
    """A linear that keeps `F.linear` for few rows or hands them to oneDNN, float64, a layer
    cast to another dtype and metadata for fewer KV groups than the model has fall back to the
    layer path (which runs them, or raises its own error)."""
    model = load_model(llama_ckpt.path, torch.float32)
    down = model.layers[1].mlp.down_proj.packed
    assert down is not None
    down.min_rows = 8
    _decode_run(model, steps=1)
    assert fused_results == [False, False]  # 5 rows < 8
    down.min_rows = 1
    _decode_run(model, steps=1)
    assert fused_results[-1] is True
    if down.large_rows_onednn:
        down.hand_over(4)
        _decode_run(model, steps=1)
        assert fused_results[-1] is False  # 5 rows >= 4: oneDNN's
        down.hand_over(linear.PANEL_MAX_ROWS)
    _decode_run(load_model(llama_ckpt.path, torch.float64), steps=1)
    assert fused_results[-1] is False
    model.layers[1].to(torch.bfloat16)
    with pytest.raises(RuntimeError):  # the layer path's own dtype error
        _decode_run(model, steps=1)
    assert fused_results[-1] is False
    hybrid = load_model(qwen3_hybrid_ckpt.path, torch.float32)
    driver = PagedDriver(hybrid, block_size=4)
    (seq,) = [driver.new_seq(p) for p in prompts([5], seed=6)]
    driver.prefill([seq])
    driver.allocate(seq, 6)
    step = SequenceStep(1, 6, [list(seq.block_tables[0])])  # the first group only
    one_group = hybrid.backend.build_metadata([step], hybrid.config.kv_groups[:1], 4, "cpu")
    ids, pos = torch.tensor(seq.tokens[5:6]), torch.tensor([5])
    assert fused_decode.decode_step(hybrid, ids, pos, one_group, driver.cache, ()) is None
    with pytest.raises(IndexError):  # the layer path indexes the missing group
        hybrid(ids, pos, one_group, driver.cache)


def test_pages_that_do_not_cover_the_keys_raise(llama_ckpt, monkeypatch) -> None:
    """A decode step whose metadata claims more keys than its pages hold is refused by the
    attention inside the fused step, as by the standalone kernel."""
    model = load_model(llama_ckpt.path, torch.float32)
    real_build = model.backend.build_metadata

    def stretched(steps, *args, **kwargs):
        meta = real_build(steps, *args, **kwargs)
        if all(step.query_len == 1 for step in steps):  # a decode step: the fused path's
            meta.groups[0].batches[0].seq_lens[0] += 64  # far past the request's pages
        return meta

    monkeypatch.setattr(model.backend, "build_metadata", stretched)
    with pytest.raises(RuntimeError, match=r"failed for 2 \(request, head\) pairs"):
        _decode_run(model, steps=1)


def test_a_block_outside_the_cache_raises(llama_ckpt) -> None:
    """A block id past the cache (a control-plane bug, or a bad frame) is an error, never a
    write or read outside the cache: in the prefill's K/V write and in a fused decode step."""
    model = load_model(llama_ckpt.path, torch.float32)
    driver = PagedDriver(model, num_blocks=16, block_size=4)
    (seq,) = [driver.new_seq(p) for p in prompts([6], seed=5)]
    seq.block_tables[0] = [1, 99]
    with pytest.raises(IndexError, match="outside the cache of 16 blocks"):
        driver.step([(seq, 6)])
    seq.block_tables[0] = [1, 2]
    driver.prefill([seq])
    seq.block_tables[0] = [1, 2]  # the decode token's slot is in block 2, the context in 1
    seq.block_tables[0][0] = 1_000  # context page far outside the cache
    with pytest.raises(RuntimeError, match=r"failed for 2 \(request, head\) pairs"):
        driver.step([(seq, 1)])
    seq.block_tables[0] = [1, 2, 77]  # 9 tokens: the new token's slot is in block 77
    seq.tokens += [5, 6]
    seq.num_computed = 8
    with pytest.raises(IndexError, match="outside the cache"):
        driver.step([(seq, 1)])


@pytest.mark.parametrize("name", ["llama_ckpt", "qwen3_hybrid_ckpt"])
def test_a_verification_block_runs_fused_as_its_tokens_would_decode(
    request, name: str, fused_results
) -> None:
    """A step of short causal blocks (speculative verification) runs as one decode row per
    token, in the fused kernel: each row's logits are those of decoding its token alone."""
    ckpt = request.getfixturevalue(name)
    model = load_model(ckpt.path, torch.float32)
    hybrid = len(model.config.kv_groups) > 1
    verify, decode = (PagedDriver(model, block_size=4, drop_out_of_window=hybrid) for _ in "ab")
    lengths = [9, 23, 14]
    blocks = [verify.new_seq(p) for p in prompts(lengths, seed=8)]
    singles = [decode.new_seq(p) for p in prompts(lengths, seed=8)]
    verify.prefill(blocks)
    decode.prefill(singles)
    drafts = [[11, 5, 40], [7, 7, 7], [3, 19, 2]]
    for seq, single, extra in zip(blocks, singles, drafts, strict=True):
        seq.tokens += extra
        single.tokens += extra
    del fused_results[:]
    block_logits = verify.step([(s, 4) for s in blocks], all_rows=True)
    assert fused_results == [True]
    rows = []
    for _ in range(4):
        rows.append(decode.step([(s, 1) for s in singles]))
    expected = torch.stack(rows, dim=1).reshape(len(lengths) * 4, -1)
    # bit for bit where the panel kernel runs every row count; a linear layer that leaves few
    # rows to `F.linear` rounds them its own way
    torch.testing.assert_close(block_logits, expected, rtol=1e-5, atol=1e-5)


def _pointed_at(tables: torch.Tensor, part_rows: int) -> list[list[list[int]]]:
    """What each part's KV group row of `group_tables` points at: its K rows, pages, first
    key positions and lengths, and its page count and window."""
    import ctypes

    def read(address: int, count: int) -> list[int]:
        return list((ctypes.c_int64 * count).from_address(address))

    out = []
    for part in tables.tolist():
        ((k_rows, pages, max_pages, first_pos, seq_lens, window),) = part
        out.append(
            [
                read(k_rows, part_rows),
                read(pages, part_rows * max_pages),
                read(first_pos, part_rows),
                read(seq_lens, part_rows),
                [max_pages, window],
            ]
        )
    return out


def test_decode_rows_point_at_what_the_metadata_holds() -> None:
    """A drafter's kernel table made from its steps (`DecodeRows`) points at the same K rows,
    pages, first key positions and lengths as `group_tables` over the attention metadata, for
    decode steps and for blocks laid out as decode rows, split into parts as `group_tables`
    splits them; steps that are not decode rows get none."""
    from specserve.shared.config import AttentionType
    from specserve.worker.attention.torch_backend import TorchAttentionBackend
    from specserve.worker.kv_cache import PagedKVCache
    from specserve.worker.model_config import KVLayerGroup

    block = 4
    group = KVLayerGroup(AttentionType.FULL, None, (0,))
    cache = PagedKVCache((group,), 16, block, 1, 8, torch.float32, "cpu")
    cases = [
        (
            [
                SequenceStep(1, 6, [[3, 7]]),
                SequenceStep(1, 1, [[9]]),
                SequenceStep(1, 13, [[1, 2, 4, 5]]),
            ],
            1,
        ),
        ([SequenceStep(4, 11, [[2, 8, 6]]), SequenceStep(2, 3, [[5]])], 1),  # 6 decode rows
        (
            [SequenceStep(1, 5 + d, [[3, 7]]) for d in range(2)]
            + [SequenceStep(1, 9 + d, [[4, 6, 10]]) for d in range(2)],
            2,  # two depths of a draft chain
        ),
    ]
    for steps, parts in cases:
        rows = fused_decode.DecodeRows.of(steps, block, "cpu")
        assert rows is not None
        metadata = TorchAttentionBackend().build_metadata(steps, (group,), block, "cpu")
        expected = fused_decode.group_tables(metadata, cache, parts)
        assert expected is not None
        part_rows = rows.rows // parts
        assert _pointed_at(rows.tables(parts), part_rows) == _pointed_at(expected, part_rows)
    long_chunk = [SequenceStep(20, 20, [[1, 2, 3, 4, 5]])]
    block_of_draft = [SequenceStep(3, 9, [[1, 2, 3]], causal=False)]
    for steps in (long_chunk, block_of_draft):
        assert fused_decode.DecodeRows.of(steps, block, "cpu") is None
