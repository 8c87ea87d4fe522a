"""EAGLE-3 and DFlash drafters against dense reference implementations.

The references (`tests/drafter_reference.py`) are plain torch over whole sequences (no paging,
no fused projections) and read the weights straight from the checkpoint files
`drafter_checkpoints.py` writes, so they check the tensor-name mapping as well as the math.
Our paged forwards run a ragged batch of two requests whose block tables are non-contiguous
and out of order, across several steps (so stale K/V from earlier draft blocks sits in the
cache and must be overwritten, never read).

Tolerance: float32 everywhere, `ATOL` 2e-5 absolute on hidden states of unit scale (the two
sides differ only in fused matmuls, SDPA versus explicit softmax, and summation order).
Target hidden states are compared with transformers at 1e-4, as the target model tests do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_checkpoints import write_random_dflash, write_random_eagle3
from drafter_reference import Dims, Weights, borrowed_head_logits, dflash_dense, eagle3_dense
from safetensors.torch import load_file, save_file

from specserve.worker.attention.base import SequenceStep
from specserve.worker.cpu import fused_decode, greedy_screen, kernels
from specserve.worker.cpu.linear import Linear
from specserve.worker.cpu.narrow_panels import round_to_q8_blocks
from specserve.worker.kv_cache import PagedKVCache
from specserve.worker.loader import load_model
from specserve.worker.models import DecoderModel
from specserve.worker.spec_decode.dflash import (
    DFlashConfig,
    DFlashDrafter,
    default_target_layer_ids,
    load_dflash,
    resolve_layer_attention,
)
from specserve.worker.spec_decode.drafter import LayerAttention
from specserve.worker.spec_decode.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3
from specserve.worker.spec_decode.speculators import SpecMethod, drafter_dtype, load_drafter

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

ATOL = 2e-5
ATOL_TARGET = 1e-4
BLOCK = 4
NUM_BLOCKS = 40
# Two requests, tables deliberately non-contiguous and descending/interleaved.
TABLES = ([31, 7, 22, 3, 15], [12, 38, 5, 27, 9])


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    path: Path
    config: dict[str, Any]
    model: DecoderModel
    hf: torch.nn.Module


def _target(tmp_path_factory: pytest.TempPathFactory, kind: str) -> Target:
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = cls(config).eval()
    path = tmp_path_factory.mktemp(f"target_{kind}")
    hf.save_pretrained(path)
    return Target(path, json.loads((path / "config.json").read_text()), load_model(path), hf)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    return _target(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    return _target(tmp_path_factory, "qwen3")


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Target:
    return request.getfixturevalue(f"{request.param}_target")


# --------------------------------------------------------------------------- paged helpers


def _slots(table: Sequence[int], positions: Sequence[int]) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def _step(query_len: int, seq_len: int, r: int) -> SequenceStep:
    return SequenceStep(query_len, seq_len, [TABLES[r]])


def _dims(path: Path) -> tuple[dict[str, torch.Tensor], Dims, dict[str, Any]]:
    config = json.loads((path / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    return load_file(path / "model.safetensors"), Dims.of(layer), config


# --------------------------------------------------------------------------- EAGLE-3

EAGLE_CASES = {
    # style, target, draft vocab, norm_before_residual, layers, lm_head, own embeddings
    "yuhuili-d2t": ("eagle3", "llama", 100, False, 1, True, False),
    "speculators-shared-head": ("speculators", "llama", None, True, 2, False, True),
    "speculators-qwen3-d2t": ("speculators", "qwen3", 64, False, 1, True, False),
}


def _eagle3_case(
    case: str, request: pytest.FixtureRequest, path: Path, seed: int
) -> tuple[Eagle3Drafter, Target, Path]:
    """A random drafter of `EAGLE_CASES[case]` written to `path`, loaded beside its target."""
    style, target_name, draft_vocab, nbr, layers, lm_head, own_embed = EAGLE_CASES[case]
    target: Target = request.getfixturevalue(f"{target_name}_target")
    path = write_random_eagle3(
        path, target.config, style, draft_vocab, seed=seed, num_layers=layers,
        aux_layer_ids=[1, 2, 4], norm_before_residual=nbr, with_lm_head=lm_head,
        with_embed_tokens=own_embed,
    )  # fmt: skip
    return load_eagle3(path, target.model), target, path


@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_eagle3_matches_dense_reference(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _, _, _, nbr, layers, _, own_embed = EAGLE_CASES[case]
    drafter, target, path = _eagle3_case(case, request, tmp_path, seed=1)
    w, d, _ = _dims(path)
    embed = w["embed_tokens.weight"] if own_embed else target.model.embed_tokens.weight
    assert (drafter.embed_tokens is not None) == own_embed
    assert drafter.aux_layer_ids() == [0, 1, 3]

    gen = torch.Generator().manual_seed(2)
    lens = [7, 5]
    ids = [torch.randint(0, 256, (n,), generator=gen) for n in lens]
    aux = [torch.randn(n, 3 * 64, generator=gen) for n in lens]
    cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)

    # First pass over all rows, as after a target step (positions 0..T-1).
    meta = drafter.build_attn_metadata([_step(n, n, r) for r, n in enumerate(lens)], BLOCK, "cpu")
    hidden = drafter.combine_hidden_states(torch.cat(aux))
    positions = torch.cat([torch.arange(n) for n in lens])
    normed, prenorm = drafter(torch.cat(ids), hidden, positions, meta, cache)
    fc = [a @ w["fc.weight"].T for a in aux]
    torch.testing.assert_close(hidden, torch.cat(fc), atol=ATOL, rtol=0)
    refs = [eagle3_dense(w, layers, nbr, embed, i, f, d) for i, f in zip(ids, fc, strict=True)]
    torch.testing.assert_close(normed, torch.cat([r[0] for r in refs]), atol=ATOL, rtol=0)
    torch.testing.assert_close(prenorm, torch.cat([r[1] for r in refs]), atol=ATOL, rtol=0)
    _check_eagle3_logits(drafter, normed, w, target)

    # Two autoregressive steps: one token each, fed its own prenorm output.
    last = torch.tensor([lens[0] - 1, sum(lens) - 1])
    feed = prenorm[last]
    for _ in range(2):
        new = torch.randint(0, 256, (2,), generator=gen)
        pos = torch.tensor([len(i) for i in ids])
        meta = drafter.build_attn_metadata(
            [_step(1, int(p) + 1, r) for r, p in enumerate(pos)], BLOCK, "cpu"
        )
        normed, feed_next = drafter(new, feed, pos, meta, cache)
        for r in range(2):
            ids[r] = torch.cat([ids[r], new[r : r + 1]])
            fc[r] = torch.cat([fc[r], feed[r : r + 1]])
            ref_normed, ref_pre = eagle3_dense(w, layers, nbr, embed, ids[r], fc[r], d)
            torch.testing.assert_close(normed[r], ref_normed[-1], atol=ATOL, rtol=0)
            torch.testing.assert_close(feed_next[r], ref_pre[-1], atol=ATOL, rtol=0)
        feed = feed_next


@pytest.mark.parametrize("case", ["yuhuili-d2t", "speculators-qwen3-d2t"])  # one layer
def test_eagle3_context_kv_alone_then_one_query_per_request(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A catch-up over rows whose outputs nobody reads writes the K/V a full pass writes; the
    last rows then run alone against it and give the full pass's outputs."""
    drafter, _, _ = _eagle3_case(case, request, tmp_path, seed=3)
    assert drafter.context_rows_are_kv
    gen = torch.Generator().manual_seed(4)
    lens = [9, 6]
    ids = torch.randint(0, 256, (sum(lens),), generator=gen)
    hidden = drafter.combine_hidden_states(torch.randn(sum(lens), 3 * 64, generator=gen))
    positions = torch.cat([torch.arange(n) for n in lens])
    full = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
    meta = drafter.build_attn_metadata([_step(n, n, r) for r, n in enumerate(lens)], BLOCK, "cpu")
    normed, prenorm = drafter(ids, hidden, positions, meta, full)

    alone = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
    slots = [s for r, n in enumerate(lens) for s in _slots(TABLES[r], range(n))]
    drafter.write_context_kv(ids, hidden, positions, torch.tensor(slots), alone)
    written = torch.tensor(slots)
    for got, want in zip(alone.layers.values(), full.layers.values(), strict=True):
        for kv in range(2):
            flat_got = got[:, kv].reshape(-1, *got.shape[3:])  # [blocks * block, heads, dim]
            flat_want = want[:, kv].reshape(-1, *want.shape[3:])
            torch.testing.assert_close(flat_got[written], flat_want[written], atol=ATOL, rtol=0)
    last = torch.tensor([lens[0] - 1, sum(lens) - 1])
    one_each = drafter.build_attn_metadata(
        [_step(1, n, r) for r, n in enumerate(lens)], BLOCK, "cpu"
    )
    normed_last, prenorm_last = drafter(ids[last], hidden[last], positions[last], one_each, alone)
    torch.testing.assert_close(normed_last, normed[last], atol=ATOL, rtol=0)
    torch.testing.assert_close(prenorm_last, prenorm[last], atol=ATOL, rtol=0)


def _prompts_pass(
    drafter: Eagle3Drafter, lens: list[int], gen: torch.Generator, cache: PagedKVCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter pass over random prompts of `lens` tokens (requests 0, 1, ... of `TABLES`):
    `(normed, prenorm)` of each request's last row."""
    meta = drafter.build_attn_metadata([_step(n, n, r) for r, n in enumerate(lens)], BLOCK, "cpu")
    hidden = drafter.combine_hidden_states(torch.randn(sum(lens), 3 * 64, generator=gen))
    ids = torch.randint(0, 256, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    normed, prenorm = drafter(ids, hidden, positions, meta, cache)
    last = torch.tensor(lens).cumsum(0) - 1
    return normed[last], prenorm[last]


@pytest.mark.skipif(
    torch.float32 not in kernels.linear_dtypes(), reason="no float32 panel kernel on this CPU"
)
@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_eagle3_one_token_steps_run_in_one_kernel_call_bit_for_bit(
    case: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft step of one token a request runs the drafter's layers in one call to the
    kernels (`fused_decode.LayerStack`, the first layer reading `[norm(embeddings),
    norm(hidden)]`), and gives the layer-by-layer path's outputs and K/V bit for bit."""
    drafter, _, _ = _eagle3_case(case, request, tmp_path, seed=5)
    fused_calls: list[bool] = []
    run = fused_decode.LayerStack.run

    def spy(*args, **kwargs):
        out = run(*args, **kwargs)
        fused_calls.append(out is not None)
        return out

    def three_steps() -> tuple[list[torch.Tensor], PagedKVCache]:
        gen = torch.Generator().manual_seed(6)
        lens = [7, 5]
        cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
        _, prenorm = _prompts_pass(drafter, lens, gen, cache)
        feed, outputs = prenorm, []
        for depth in range(3):
            pos = torch.tensor([n + depth for n in lens])
            meta = drafter.build_attn_metadata(
                [_step(1, int(p) + 1, r) for r, p in enumerate(pos)], BLOCK, "cpu"
            )
            normed, feed = drafter(
                torch.randint(0, 256, (2,), generator=gen), feed, pos, meta, cache
            )
            outputs += [normed, feed]
        return outputs, cache

    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the kernel's team, split unevenly
    try:
        with monkeypatch.context() as patch:
            patch.setattr(fused_decode.LayerStack, "run", spy)
            fused, fused_cache = three_steps()
        # the prompts too: short causal blocks run as one decode row a token
        assert fused_calls == [True] * 4
        with monkeypatch.context() as patch:
            patch.setattr(fused_decode.LayerStack, "of", lambda *args, **kwargs: None)
            layered, layered_cache = three_steps()
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(fused, layered, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(fused_cache.layers.values(), layered_cache.layers.values(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(
    torch.float32 not in kernels.linear_dtypes(), reason="no float32 panel kernel on this CPU"
)
@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_eagle3_greedy_chain_is_the_depth_by_depth_drafts_bit_for_bit(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`greedy_chain` drafts three more depths for two requests with the metadata, RoPE
    tables and layer table made once: each depth's drafts and the K/V it leaves are those of
    `forward` then `greedy_drafts` depth by depth, bit for bit. Steps that do not fit the
    kernel (two tokens a request) get None and leave the cache as it was."""
    drafter, _, _ = _eagle3_case(case, request, tmp_path, seed=7)
    lens = [7, 5]

    def first_pass() -> tuple[torch.Tensor, torch.Tensor, PagedKVCache]:
        cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
        normed, prenorm = _prompts_pass(drafter, lens, torch.Generator().manual_seed(8), cache)
        return drafter.greedy_drafts(normed), prenorm, cache

    tokens, feed, stepped_cache = first_pass()
    stepped = []
    for depth in range(1, 4):
        pos = torch.tensor([n - 1 + depth for n in lens])
        meta = drafter.build_attn_metadata(
            [_step(1, int(p) + 1, r) for r, p in enumerate(pos)], BLOCK, "cpu"
        )
        normed, feed = drafter(tokens, feed, pos, meta, stepped_cache)
        tokens = drafter.greedy_drafts(normed)
        stepped.append(tokens)

    tokens, feed, chained_cache = first_pass()
    untouched = [t.clone() for t in chained_cache.layers.values()]
    two_each = [_step(2, n + 2, r) for r, n in enumerate(lens)]
    assert drafter.greedy_chain(tokens, feed, two_each, chained_cache) is None
    for got, want in zip(chained_cache.layers.values(), untouched, strict=True):
        assert torch.equal(got, want)
    steps = [_step(1, n + depth, r) for depth in range(1, 4) for r, n in enumerate(lens)]
    chained = drafter.greedy_chain(tokens, feed, steps, chained_cache)
    assert chained is not None and len(chained) == 3
    for got, want in zip(chained, stepped, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(chained_cache.layers.values(), stepped_cache.layers.values(), strict=True):
        assert torch.equal(got, want)


# Drafters whose greedy chain runs in one C call (`draft_chain`): a draft head of its own with
# `d2t`, the norm before or after the residual, embeddings borrowed or the drafter's own.
CHAIN_CASES = {
    "d2t": ("eagle3", 100, False, False),
    "norm-before-residual": ("speculators", 64, True, False),
    "own-embeddings": ("speculators", 100, False, True),
    "full-vocab-head": ("eagle3", None, False, False),  # no d2t: the Python chain
}
CHAIN_DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            torch.bfloat16 not in kernels.linear_dtypes(), reason="no bfloat16 panel kernel"
        ),
    ),
]


@pytest.mark.skipif(
    torch.float32 not in kernels.linear_dtypes(), reason="no float32 panel kernel on this CPU"
)
@pytest.mark.parametrize("dtype", CHAIN_DTYPES)
@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_eagle3_draft_chain_in_one_call_is_the_python_chain_bit_for_bit(
    case: str,
    dtype: torch.dtype,
    llama_target: Target,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the draft head has its own reduced vocabulary, `greedy_chain`'s depths run in one
    C call (`LayerStack.run_chain`), for float32 and bfloat16 drafters (bfloat16 reading the
    float32 target's embeddings rounded), and give the drafts and drafter K/V of the chain
    run depth by depth from Python, bit for bit, on a team of three threads; a head over the
    whole vocabulary keeps the Python chain. (A float32 draft head is otherwise read through
    its screen, whose argmax is the head's own: the screen is put aside here.)"""
    style, draft_vocab, nbr, own_embed = CHAIN_CASES[case]
    path = write_random_eagle3(
        tmp_path, llama_target.config, style, draft_vocab, seed=11,
        aux_layer_ids=[1, 2, 4], norm_before_residual=nbr, with_embed_tokens=own_embed,
    )  # fmt: skip
    drafter = load_eagle3(path, llama_target.model, dtype)
    monkeypatch.setattr(Eagle3Drafter, "head_screen", lambda self: None)
    lens = [7, 5, 9]
    tables = ([31, 7, 22, 3, 15], [12, 38, 5, 27, 9], [2, 4, 6, 8, 10])
    calls: list[int] = []
    run_chain = fused_decode.LayerStack.run_chain

    def spy(*args, **kwargs):
        calls.append(1)
        return run_chain(*args, **kwargs)

    def chain(in_one_call: bool) -> tuple[list[torch.Tensor], PagedKVCache]:
        cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
        gen = torch.Generator().manual_seed(12)
        meta = drafter.build_attn_metadata(
            [SequenceStep(n, n, [tables[r]]) for r, n in enumerate(lens)], BLOCK, "cpu"
        )
        hidden = drafter.combine_hidden_states(torch.randn(sum(lens), 3 * 64, generator=gen))
        ids = torch.randint(0, 256, (sum(lens),), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lens])
        normed, prenorm = drafter(ids, hidden, positions, meta, cache)
        last = torch.tensor(lens).cumsum(0) - 1
        tokens, feed = drafter.greedy_drafts(normed[last]), prenorm[last]
        before = feed.clone()
        steps = [
            SequenceStep(1, n + depth, [tables[r]])
            for depth in range(1, 5)
            for r, n in enumerate(lens)
        ]
        with monkeypatch.context() as patch:
            patch.setattr(fused_decode.LayerStack, "run_chain", spy)
            if not in_one_call:
                patch.setattr(fused_decode.LayerStack, "chain_table", lambda *args, **kwargs: None)
            drafts = drafter.greedy_chain(tokens, feed, steps, cache)
        assert torch.equal(feed, before)  # the caller's state is not written
        assert drafts is not None and len(drafts) == 4
        return [tokens, *drafts], cache

    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        in_one_call, one_call_cache = chain(True)
        assert calls == ([] if draft_vocab is None else [1])
        python, python_cache = chain(False)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == (0 if draft_vocab is None else 1)
    for got, want in zip(in_one_call, python, strict=True):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    assert len({tuple(t.tolist()) for t in python[1:]}) > 1  # the depths draft differently
    for got, want in zip(one_call_cache.layers.values(), python_cache.layers.values(), strict=True):
        assert torch.equal(got, want)


def _check_eagle3_logits(
    drafter: Eagle3Drafter, normed: torch.Tensor, w: Weights, target: Target
) -> None:
    logits = drafter.compute_logits(normed)
    assert logits.shape == (normed.shape[0], 256)
    if "lm_head.weight" not in w:  # shared with the target
        assert torch.equal(logits, borrowed_head_logits(target.model, normed))
        return
    draft_logits = normed @ w["lm_head.weight"].T
    if "d2t" not in w:
        torch.testing.assert_close(logits, draft_logits, atol=ATOL, rtol=0)
        return
    # target id = draft id + d2t[draft id]; every other target id is impossible.
    mapped = torch.arange(len(w["d2t"])) + w["d2t"]
    assert torch.equal(drafter.draft_to_target, mapped)
    assert torch.equal(mapped, w["t2d"].nonzero().flatten())
    torch.testing.assert_close(logits[:, mapped], draft_logits, atol=ATOL, rtol=0)
    others = torch.ones(256, dtype=torch.bool)
    others[mapped] = False
    assert bool(torch.isneginf(logits[:, others]).all())
    assert torch.equal(logits.argmax(-1), mapped[draft_logits.argmax(-1)])
    assert torch.equal(drafter.greedy_drafts(normed), logits.argmax(-1))


@pytest.mark.parametrize("rising", [True, False])
def test_eagle3_greedy_drafts_are_the_full_rows_argmax_first_index_on_ties(
    rising: bool, llama_target: Target, tmp_path: Path
) -> None:
    """Greedy drafts come from the draft vocabulary's logits alone where its target ids rise
    with the draft ids, else from the full rows; the token is the full row's argmax either
    way, ties (a zero hidden state ties every logit) going to the first target id."""
    path = write_random_eagle3(
        tmp_path, llama_target.config, "eagle3", 100, seed=7, aux_layer_ids=[1, 2, 4]
    )
    if not rising:  # two draft ids swap their target ids
        tensors = load_file(path / "model.safetensors")
        ids = torch.arange(100) + tensors["d2t"]
        ids[[0, 1]] = ids[[1, 0]]
        tensors["d2t"] = ids - torch.arange(100)
        save_file(tensors, path / "model.safetensors")
    drafter = load_eagle3(path, llama_target.model)
    assert drafter._draft_ids_rise == rising
    normed = torch.cat(
        [torch.zeros(1, 64), torch.randn(6, 64, generator=torch.Generator().manual_seed(8))]
    )
    full = drafter.compute_logits(normed)
    drafts = drafter.greedy_drafts(normed)
    assert torch.equal(drafts, full.argmax(-1))
    assert int(drafts[0]) == int(drafter.draft_to_target.min())  # all tied: the first target id


def test_eagle3_greedy_drafts_read_the_draft_heads_screen(
    llama_target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 draft head packed as panels has a screen (`cpu.greedy_screen`: an int8 or
    bfloat16 copy), and greedy drafts read it: the head's own argmax, near-ties included."""
    path = write_random_eagle3(
        tmp_path, llama_target.config, "eagle3", 100, seed=7, aux_layer_ids=[1, 2, 4]
    )
    drafter = load_eagle3(path, llama_target.model, torch.float32)
    screen = drafter.head_screen()
    if greedy_screen.default_copy() is None:
        assert screen is None
        pytest.skip("no bfloat16 panels on this CPU: no screen")
    assert screen is not None and screen.head is drafter.lm_head.packed
    answers: list[torch.Tensor | None] = []
    argmax = screen.argmax

    def spy(rows: torch.Tensor) -> torch.Tensor | None:
        answers.append(argmax(rows))
        return answers[-1]

    monkeypatch.setattr(screen, "argmax", spy)
    head = drafter.lm_head.weight.detach()
    g = torch.Generator().manual_seed(3)
    normed = torch.randn(6, 64, generator=g)
    # Rows along the sum of two columns and orthogonal to their difference: the two logits
    # tie but for float32 rounding.
    pairs = [(3, 7), (10, 11), (40, 90)]
    for row, (a, b) in enumerate(pairs):
        along, apart = (head[a] + head[b]).double() * 4, (head[a] - head[b]).double()
        normed[row] = (along - (along @ apart) / (apart @ apart) * apart).float()
    best = drafter.lm_head(normed).argmax(-1)
    assert all(int(best[row]) in pair for row, pair in enumerate(pairs))  # ties but for rounding
    drafts = drafter.greedy_drafts(normed)
    assert len(answers) == 1 and answers[0] is not None  # the screen answered every row
    assert torch.equal(answers[0], best)
    assert torch.equal(drafts, drafter.draft_to_target[best])
    # A cast packs the head again: no screen for a bfloat16 head, a new one back in float32.
    drafter.to(torch.bfloat16)
    assert drafter.head_screen() is None
    drafter.to(torch.float32)
    again = drafter.head_screen()
    assert again is not None and again is not screen and again.head is drafter.lm_head.packed


def test_eagle3_config_formats(llama_target: Target, tmp_path: Path) -> None:
    """Both formats parse to the same drafter description."""
    configs = {}
    for style in ("eagle3", "speculators"):
        path = write_random_eagle3(
            tmp_path / style, llama_target.config, style, 100, aux_layer_ids=[1, 2, 4],
            norm_before_residual=True,
        )  # fmt: skip
        configs[style] = Eagle3Config.from_hf(json.loads((path / "config.json").read_text()))
    a, b = configs["eagle3"], configs["speculators"]
    assert (a.style, b.style) == ("eagle3", "speculators")
    for c in (a, b):
        assert c.draft_vocab_size == 100
        assert c.norm_before_residual is True
        assert c.checkpoint_aux_layer_ids == (1, 2, 4)
        assert c.layer.hidden_size == 64 and c.layer.num_layers == 1
        assert c.layer.num_kv_heads == 2 and not c.layer.qk_norm
    # Aux ids may also sit at the top level of the yuhuili format, or use the short
    # speculators spelling.
    top = {**json.loads((tmp_path / "eagle3" / "config.json").read_text())}
    top.pop("eagle_config")
    top["eagle_aux_hidden_state_layer_ids"] = [3, 4, 1]
    assert Eagle3Config.from_hf(top).checkpoint_aux_layer_ids == (3, 4, 1)
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    spec["aux_hidden_state_layer_ids"] = spec.pop("eagle_aux_hidden_state_layer_ids")
    assert Eagle3Config.from_hf(spec).checkpoint_aux_layer_ids == (1, 2, 4)


def test_eagle3_aux_layer_id_convention() -> None:
    """Checkpoint ids mean "input of layer i"; ours mean "output of layer i": ours = id - 1."""
    config = Eagle3Config.from_hf(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": 256,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 16, 32]},
        }
    )
    assert config.aux_layer_ids(32) == [0, 15, 31]
    default = replace(config, checkpoint_aux_layer_ids=None)
    assert default.aux_layer_ids(32) == [1, 15, 28]  # checkpoint default (2, L//2, L-3)
    assert default.aux_layer_ids(36) == [1, 17, 32]
    with pytest.raises(ValueError, match=r"\[0\].*out of range 1\.\.4"):
        replace(config, checkpoint_aux_layer_ids=(0, 1, 2)).aux_layer_ids(4)
    with pytest.raises(ValueError, match="out of range"):
        config.aux_layer_ids(31)


def test_aux_layer_ids_select_the_documented_hidden_states(llama_target: Target) -> None:
    """HF `hidden_states[i]` is the input of layer i (EAGLE-3 checkpoint id i) and the output
    of layer i-1 (DFlash id i-1); our `forward_with_aux` ids are the latter for both."""
    model = llama_target.model
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = llama_target.hf(ids[None], output_hidden_states=True).hidden_states
    eagle = Eagle3Config.from_hf(
        {"architectures": ["LlamaForCausalLMEagle3"], **_llama_layer(), "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    )  # fmt: skip
    dflash = DFlashConfig.from_hf(
        {"architectures": ["DFlashDraftModel"], **_llama_layer(), "head_dim": 16,
         "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0, 2]}}
    )  # fmt: skip
    cache = PagedKVCache(model.config.kv_groups, 8, BLOCK, 2, 16, torch.float32, "cpu")
    steps = [SequenceStep(9, 9, [[1, 2, 3]])]
    for ckpt_ids, ours in (
        (eagle.checkpoint_aux_layer_ids, eagle.aux_layer_ids(4)),
        ([i + 1 for i in dflash.target_layer_ids], list(dflash.target_layer_ids)),
    ):
        meta = model.backend.build_metadata(steps, model.config.kv_groups, BLOCK, "cpu")
        _, aux = model.forward_with_aux(ids, torch.arange(9), meta, cache, ours)
        for hf_index, captured in zip(ckpt_ids, aux, strict=True):
            torch.testing.assert_close(captured, hf[hf_index][0], atol=ATOL_TARGET, rtol=0)


def _llama_layer() -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 256,
    }


def test_eagle3_accepts_both_layer_prefixes_and_model_prefix(
    llama_target: Target, tmp_path: Path
) -> None:
    path = write_random_eagle3(tmp_path / "a", llama_target.config, "eagle3", 100, seed=4)
    tensors = load_file(path / "model.safetensors")
    assert any(n.startswith("midlayer.") for n in tensors)
    renamed = {"model." + n.replace("midlayer.", "layers.0."): t for n, t in tensors.items()}
    other = tmp_path / "b"
    other.mkdir()
    (other / "config.json").write_text((path / "config.json").read_text())
    save_file(renamed, other / "model.safetensors")
    a, b = load_eagle3(path, llama_target.model), load_eagle3(other, llama_target.model)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_eagle3_shares_a_saved_copy_of_target_embeddings(
    llama_target: Target, tmp_path: Path
) -> None:
    path = write_random_eagle3(tmp_path, llama_target.config, "speculators", with_embed_tokens=True)
    tensors = load_file(path / "model.safetensors")
    tensors["embed_tokens.weight"] = llama_target.model.embed_tokens.weight.clone()
    save_file(tensors, path / "model.safetensors")
    drafter = load_eagle3(path, llama_target.model)
    assert drafter.embed_tokens is None
    assert "embed_tokens.weight" not in drafter.state_dict()


def test_drafter_dtype_auto_takes_bfloat16_where_it_pays(
    llama_target: Target, tmp_path: Path
) -> None:
    """`--drafter-dtype auto`: the target's dtype, except bfloat16 for a 16-bit checkpoint beside
    a float32 target on a CPU with bfloat16 arithmetic (not AVX2, whose panels widen bfloat16);
    a named dtype as given. A bfloat16 drafter that borrows the float32 target's LM head gets
    its logits as `borrowed_head_logits` says."""
    target = llama_target.model
    assert target.dtype == torch.float32
    path = write_random_eagle3(tmp_path, llama_target.config, "speculators", with_lm_head=False)
    fast_bf16 = torch.bfloat16 in kernels.linear_dtypes() and not kernels.linear_widens_bfloat16()
    for saved, auto in (
        ("bfloat16", torch.bfloat16 if fast_bf16 else torch.float32),
        ("float16", torch.bfloat16 if fast_bf16 else torch.float32),
        ("float32", torch.float32),
    ):
        _edit_config(path, torch_dtype=saved)
        assert drafter_dtype("auto", str(path), target) == auto, saved
        assert drafter_dtype("float32", str(path), target) == torch.float32
        assert drafter_dtype("bfloat16", str(path), target) == torch.bfloat16
    drafter = load_eagle3(path, target, torch.bfloat16)
    assert drafter.dtype == torch.bfloat16 and drafter.lm_head is None
    hidden = torch.randn(3, target.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(drafter.compute_logits(hidden), borrowed_head_logits(target, hidden))


@pytest.mark.skipif(not kernels.linear_narrow_max_rows(8), reason="no 8-bit panels here")
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_float32_drafter_chosen_by_auto_reads_its_layers_as_8bit_blocks(
    method: str, llama_target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `--drafter-dtype auto` keeps a drafter in float32 (here: the panels made to widen
    bfloat16, as on AVX2), its own linears but the draft head are rounded to 8-bit blocks and
    read as 8-bit panels; a drafter asked for in float32 keeps its checkpoint's values."""
    monkeypatch.setattr(kernels, "linear_widens_bfloat16", lambda: True)
    target = llama_target.model
    if method == "eagle3":
        path = write_random_eagle3(tmp_path, llama_target.config, "speculators")
    else:
        path = write_random_dflash(
            tmp_path, llama_target.config, num_layers=2, target_layer_ids=[0, 2],
            mask_token_id=255, block_size=4,
        )  # fmt: skip
    exact = load_drafter(SpecMethod(method), str(path), target, "float32")
    auto = load_drafter(SpecMethod(method), str(path), target, "auto")
    assert auto.dtype == exact.dtype == torch.float32
    linears = [(n, m) for n, m in auto.named_modules() if isinstance(m, Linear)]
    kept = dict(exact.named_modules())
    rounded = 0
    for name, module in linears:
        weight = kept[name].weight
        if name == "lm_head":
            assert torch.equal(module.weight, weight)
            continue
        assert torch.equal(module.weight, round_to_q8_blocks(weight)), name
        assert not torch.equal(module.weight, weight), name
        assert (module.packed.bits, kept[name].packed.bits) == (8, 0), name
        rounded += 1
    assert rounded == len(linears) - (method == "eagle3")


def _edit(path: Path, drop: Sequence[str] = (), add: Mapping[str, torch.Tensor] = {}) -> None:
    tensors = load_file(path / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add)
    save_file(tensors, path / "model.safetensors")


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_eagle3_load_errors(llama_target: Target, tmp_path: Path) -> None:
    model = llama_target.model

    def fresh(name: str, **kw: Any) -> Path:
        return write_random_eagle3(tmp_path / name, llama_target.config, "eagle3", **kw)

    path = fresh("missing", draft_vocab_size=100)
    _edit(path, drop=["midlayer.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.0\.self_attn\.k_proj.*midlayer"):
        load_eagle3(path, model)

    path = fresh("no_d2t", draft_vocab_size=100)
    _edit(path, drop=["d2t"])
    with pytest.raises(ValueError, match="needs a 'd2t'"):
        load_eagle3(path, model)

    path = fresh("bad_d2t", draft_vocab_size=100)
    _edit(path, add={"d2t": torch.full((100,), 200)})
    with pytest.raises(ValueError, match="outside the target vocab"):
        load_eagle3(path, model)

    path = fresh("no_head", draft_vocab_size=100)
    _edit(path, drop=["lm_head.weight"])
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        load_eagle3(path, model)

    path = fresh("extra")
    _edit(path, add={"midlayer.self_attn.rotary.weird": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected tensors: midlayer\.self_attn\.rotary"):
        load_eagle3(path, model)

    path = fresh("bad_shape")
    _edit(path, add={"fc.weight": torch.zeros(64, 128)})
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(64, 128\).*\(64, 192\)"):
        load_eagle3(path, model)

    path = fresh("bad_ids", aux_layer_ids=[1, 2, 9])
    with pytest.raises(ValueError, match=r"\[9\].*out of range 1\.\.4"):
        load_eagle3(path, model)

    path = fresh("bad_arch")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="not an EAGLE-3 config"):
        load_eagle3(path, model)

    path = fresh("bad_hidden")
    _edit_config(path, target_hidden_size=128)
    with pytest.raises(ValueError, match="target_hidden_size 128"):
        load_eagle3(path, model)


# --------------------------------------------------------------------------- DFlash

NC, C = LayerAttention(False), LayerAttention(True)
DFLASH_CASES = {
    # target, layer_types, sliding_window, is_causal override, expected per-layer attention
    "all-non-causal": ("qwen3", None, None, None, [NC, NC, NC]),
    "mixed-causal": (
        "qwen3",
        ["sliding_attention", "full_attention", "sliding_attention"],
        None,
        None,
        [C, NC, C],
    ),
    "mixed-windowed": (
        "llama",
        ["full_attention", "sliding_attention", "sliding_attention"],
        5,
        None,
        [NC, LayerAttention(True, 5), LayerAttention(True, 5)],
    ),
    "is-causal-override": ("llama", ["full_attention"] * 3, None, True, [C, C, C]),
}


@pytest.mark.parametrize("case", list(DFLASH_CASES))
def test_dflash_matches_dense_reference(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    target_name, layer_types, window, is_causal, kinds = DFLASH_CASES[case]
    target: Target = request.getfixturevalue(f"{target_name}_target")
    mask_id, k = 255, 3
    path = write_random_dflash(
        tmp_path, target.config, num_layers=3, target_layer_ids=[0, 2, 3],
        mask_token_id=mask_id, block_size=k + 1, seed=5, layer_types=layer_types,
        sliding_window=window, is_causal=is_causal,
    )  # fmt: skip
    drafter = load_dflash(path, target.model)
    w, d, _ = _dims(path)
    assert list(drafter.config.layer_attention) == kinds
    embed = target.model.embed_tokens.weight
    assert drafter.aux_layer_ids() == [0, 2, 3]
    assert drafter.mask_token_id == mask_id

    gen = torch.Generator().manual_seed(6)
    cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
    features: list[torch.Tensor] = [torch.empty(0, 3 * 64), torch.empty(0, 3 * 64)]
    # Step 1: prompts of 6 and 9 tokens become context; step 2: 3 and 1 rows accepted.
    for new_rows in ([6, 9], [3, 1]):
        ctx_feats, ctx_pos, ctx_slots = [], [], []
        for r, n in enumerate(new_rows):
            rows = torch.randn(n, 3 * 64, generator=gen)
            start = len(features[r])
            features[r] = torch.cat([features[r], rows])
            ctx_feats.append(rows)
            ctx_pos += range(start, start + n)
            ctx_slots += _slots(TABLES[r], range(start, start + n))
        drafter.write_context_kv(
            drafter.combine_hidden_states(torch.cat(ctx_feats)),
            torch.tensor(ctx_pos),
            torch.tensor(ctx_slots),
            cache,
        )
        blocks = [
            torch.cat([torch.randint(0, 255, (1,), generator=gen), torch.full((k,), mask_id)])
            for _ in range(2)
        ]
        ctx_lens = [len(f) for f in features]
        steps = [_step(k + 1, n + k + 1, r) for r, n in enumerate(ctx_lens)]
        positions = torch.cat([torch.arange(n, n + k + 1) for n in ctx_lens])
        meta = drafter.build_attn_metadata(steps, BLOCK, "cpu")
        out = drafter(torch.cat(blocks), positions, meta, cache)
        ref = torch.cat(
            [dflash_dense(w, kinds, embed, f, b, d) for f, b in zip(features, blocks, strict=True)]
        )
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert torch.equal(drafter.compute_logits(out), borrowed_head_logits(target.model, out))


def test_dflash_non_causal_layers_see_the_whole_block(qwen3_target: Target, tmp_path: Path) -> None:
    """Changing the last mask token changes earlier rows only through non-causal layers."""
    outs = {}
    for name, causal in (("nc", None), ("c", True)):
        path = write_random_dflash(
            tmp_path / name, qwen3_target.config, 2, [1, 3], 255, 4, seed=7, is_causal=causal
        )
        drafter = load_dflash(path, qwen3_target.model)
        rows = []
        for last in (255, 17):
            cache = drafter.make_kv_cache(NUM_BLOCKS, BLOCK)
            ctx = drafter.combine_hidden_states(torch.ones(5, 128))
            drafter.write_context_kv(
                ctx, torch.arange(5), torch.tensor(_slots(TABLES[0], range(5))), cache
            )
            meta = drafter.build_attn_metadata([_step(4, 9, 0)], BLOCK, "cpu")
            rows.append(drafter(torch.tensor([3, 255, 255, last]), torch.arange(5, 9), meta, cache))
        outs[name] = rows
    assert not torch.allclose(outs["nc"][0][0], outs["nc"][1][0])
    torch.testing.assert_close(outs["c"][0][:3], outs["c"][1][:3], atol=0, rtol=0)


def test_dflash_layer_attention_resolution() -> None:
    types = ["sliding_attention", "full_attention"]

    def kinds(**hf: Any) -> list[tuple[bool, int | None]]:
        return [(a.causal, a.sliding_window) for a in resolve_layer_attention(hf, 2)]

    assert kinds() == [(False, None), (False, None)]  # no layer_types: non-causal
    assert kinds(layer_types=types) == [(True, None), (False, None)]
    assert kinds(layer_types=types, sliding_window=8) == [(True, 8), (False, None)]
    assert kinds(layer_types=["sliding_attention"] * 2) == [(True, None), (True, None)]
    assert kinds(layer_types=types, dflash_config={"causal": False}) == [(False, None)] * 2
    assert kinds(dflash_config={"causal": True}) == [(True, None)] * 2
    # The top-level override wins over dflash_config.causal.
    assert (
        kinds(layer_types=types, is_causal=False, dflash_config={"causal": True})
        == [(False, None)] * 2
    )
    assert kinds(dflash_config={"use_swa": True, "swa_window_size": 6}) == [(False, 6)] * 2
    with pytest.raises(ValueError, match="2 layers"):
        kinds(layer_types=types[:1])
    with pytest.raises(ValueError, match="unsupported layer types"):
        kinds(layer_types=["linear_attention"] * 2)


def test_dflash_target_layer_id_convention() -> None:
    """DFlash ids already mean "output of layer i" (HF hidden_states[i+1]): used unchanged,
    while a vLLM-style target (capturing layer inputs) would need id + 1."""
    base = {"architectures": ["DFlashDraftModel"], **_llama_layer(), "num_hidden_layers": 5}
    config = DFlashConfig.from_hf(
        {**base, "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 9, 17, 25, 33]}}
    )
    assert config.target_layer_ids == (1, 9, 17, 25, 33)
    # Missing ids: the reference default, spread over 1..L-3 (or L//2 for one layer).
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    derived = DFlashConfig.from_hf(
        {**base, "num_target_layers": 36, "dflash_config": {"mask_token_id": 7}}
    )
    assert derived.target_layer_ids == (1, 9, 17, 25, 33)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_hf({**base, "dflash_config": {"target_layer_ids": [1]}})


def test_dflash_load_errors(qwen3_target: Target, tmp_path: Path) -> None:
    model = qwen3_target.model

    def fresh(name: str, ids: Sequence[int] = (0, 2), mask: int = 255) -> Path:
        return write_random_dflash(tmp_path / name, qwen3_target.config, 2, ids, mask, 4)

    path = fresh("missing")
    _edit(path, drop=["hidden_norm.weight"])
    with pytest.raises(
        ValueError, match=r"DFlash checkpoint is missing tensor 'hidden_norm\.weight'"
    ):
        load_dflash(path, model)

    path = fresh("missing_qnorm")
    _edit(path, drop=["layers.1.self_attn.q_norm.weight"])
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.self_attn\.q_norm\.weight'"):
        load_dflash(path, model)

    path = fresh("extra")
    _edit(path, add={"d2t": torch.zeros(10, dtype=torch.int64)})
    with pytest.raises(ValueError, match="unexpected tensors: d2t"):
        load_dflash(path, model)

    with pytest.raises(ValueError, match=r"\[4\].*out of range 0\.\.3"):
        load_dflash(fresh("bad_ids", ids=(0, 4)), model)
    with pytest.raises(ValueError, match="mask_token_id 300"):
        load_dflash(fresh("bad_mask", mask=300), model)

    path = fresh("other_target")
    _edit_config(path, num_target_layers=36)
    with pytest.raises(ValueError, match="36-layer target"):
        load_dflash(path, model)

    path = fresh("bad_arch")
    _edit_config(path, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="not a DFlash config"):
        load_dflash(path, model)


def test_dflash_combine_rejects_wrong_width(qwen3_target: Target, tmp_path: Path) -> None:
    path = write_random_dflash(tmp_path, qwen3_target.config, 1, [1, 2], 255, 4)
    drafter: DFlashDrafter = load_dflash(path, qwen3_target.model)
    with pytest.raises(ValueError, match="expects 128 features"):
        drafter.combine_hidden_states(torch.zeros(3, 192))
    with pytest.raises(ValueError, match="one block table"):
        drafter.build_attn_metadata([SequenceStep(4, 8, [[1, 2], [3, 4]])], BLOCK, "cpu")
