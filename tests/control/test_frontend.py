"""The frontend: prompts to token ids (with clear errors), tokens back to streamed text."""

from __future__ import annotations

import pytest

from specserve.control.frontend import ClientRequest, Frontend
from specserve.control.metrics import ServiceMetrics
from specserve.shared.protocol import PROTOCOL_VERSION, GenerateRequest, SamplingParams
from specserve.shared.tokenizer import Tokenizer, load_tokenizer


def make_frontend(tokenizer: Tokenizer | None) -> Frontend:
    return Frontend(tokenizer, ServiceMetrics(), send=lambda *_: True, withdraw=lambda _: None)


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    return make_frontend(load_tokenizer("smollm2-135m"))


def request(**fields) -> GenerateRequest:
    return GenerateRequest(PROTOCOL_VERSION, "r", **fields)


def test_text_chat_and_token_prompts(frontend: Frontend):
    tok = frontend.tokenizer
    assert frontend.prompt_token_ids(request(prompt="Hello there"), 49152) == tok.encode(
        "Hello there"
    )
    chat = frontend.prompt_token_ids(request(prompt="Hi", chat=True), 49152)
    assert tok.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert frontend.prompt_token_ids(request(prompt_token_ids=[5, 6]), 49152) == [5, 6]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of prompt"),
        ({"prompt_token_ids": [1, 49152]}, r"\[49152\] are outside the vocabulary"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"prompt_token_ids": [1], "chat": True}, "chat applies to text prompts only"),
    ],
)
def test_bad_prompts_are_named(frontend: Frontend, fields: dict, message: str):
    with pytest.raises(ValueError, match=message):
        frontend.prompt_token_ids(request(**fields), 49152)


def test_bad_sampling_is_rejected_as_the_request_enters(frontend: Frontend):
    msg = request(prompt_token_ids=[1, 2], sampling=SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="top_p must be in"):
        frontend.accept(b"c", msg, 49152, ())
    assert not frontend.requests


def test_a_model_without_tokenizer_needs_token_ids():
    with pytest.raises(ValueError, match="send prompt_token_ids"):
        make_frontend(None).prompt_token_ids(request(prompt="hi"), 10)


def test_streamed_text_never_splits_a_character(frontend: Frontend):
    tok = frontend.tokenizer
    prompt = tok.encode("Say:")
    target = " café 日本語 🙂 done"
    ids = tok.encode(target, add_special_tokens=False)
    req = ClientRequest("r", b"c", prompt, SamplingParams(), True, None, 0, None)
    pieces = []
    for token in ids:
        req.output_token_ids.append(token)
        delta = frontend.text_delta(req, final=False)
        assert "\ufffd" not in delta
        pieces.append(delta)
    pieces.append(frontend.text_delta(req, final=True))
    assert "".join(pieces) == tok.decode(ids)


def test_every_eos_id_stops_unless_eos_is_ignored():
    params = SamplingParams(stop_token_ids=(7,))
    assert Frontend.with_stop_ids(params, (2, 3, 7)).stop_token_ids == (7, 3)
    assert Frontend.with_stop_ids(params, (2,)) is params
    ignoring = SamplingParams(ignore_eos=True)
    assert Frontend.with_stop_ids(ignoring, (2, 3)) is ignoring
