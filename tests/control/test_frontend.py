"""The frontend: prompts to token ids (with clear errors), tokens back to streamed text."""

from __future__ import annotations

import pytest

from specserve.control.frontend import AlreadyResumed, ClientRequest, Frontend, PromptLimit
from specserve.control.metrics import ServiceMetrics
from specserve.shared.protocol import PROTOCOL_VERSION, GenerateRequest, Resume, SamplingParams
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
        delta, stopped = frontend.text_delta(req, final=False)
        assert "\ufffd" not in delta and not stopped
        pieces.append(delta)
    pieces.append(frontend.text_delta(req, final=True)[0])
    assert "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("stop", [(" 日本",), ("zzz", "é 日"), ("🙂 d",)])
def test_stop_strings_end_the_text_before_them_and_never_leak(frontend: Frontend, stop):
    """Token by token, no delta ever holds any part of the first stop string, and the text
    sent is exactly what comes before it."""
    tok = frontend.tokenizer
    target = " café 日本語 🙂 done"
    ids = tok.encode(target, add_special_tokens=False)
    req = ClientRequest(
        "r", b"c", tok.encode("Say:"), SamplingParams(stop=stop), True, None, 0, None
    )
    sent, stopped_at = "", None
    for n, token in enumerate(ids):
        req.output_token_ids.append(token)
        delta, stopped = frontend.text_delta(req, final=False)
        sent += delta
        if stopped:
            stopped_at = n
            break
    full = tok.decode(ids)
    first = min(full.find(s) for s in stop if s in full)
    assert sent == full[:first]
    # it stopped at the token that completed the stop string, not later
    assert stopped_at is not None
    assert any(s in tok.decode(ids[: stopped_at + 1]) for s in stop)
    assert not any(s in tok.decode(ids[:stopped_at]) for s in stop)


def test_held_stop_prefix_is_sent_when_the_request_ends_without_it(frontend: Frontend):
    tok = frontend.tokenizer
    ids = tok.encode(" one two", add_special_tokens=False)
    req = ClientRequest(
        "r", b"c", tok.encode("Say:"), SamplingParams(stop=("two three",)), True, None, 0, None
    )
    pieces = []
    for token in ids:
        req.output_token_ids.append(token)
        pieces.append(frontend.text_delta(req, final=False)[0])
    assert "".join(pieces) == ""  # " one two" is 8 characters: all could begin "two three"
    assert frontend.text_delta(req, final=True) == (" one two", False)


def test_every_eos_id_stops_unless_eos_is_ignored():
    params = SamplingParams(stop_token_ids=(7,))
    assert Frontend.with_stop_ids(params, (2, 3, 7)).stop_token_ids == (7, 3)
    assert Frontend.with_stop_ids(params, (2,)) is params
    ignoring = SamplingParams(ignore_eos=True)
    assert Frontend.with_stop_ids(ignoring, (2, 3)) is ignoring


# --- limits: cheap checks first ---------------------------------------------------------------


def test_prompt_length_is_checked_before_the_ids_are(frontend: Frontend, monkeypatch):
    def no_range_check(*_):
        raise AssertionError("the ids were range-checked before the length")

    monkeypatch.setattr("specserve.control.frontend.check_token_ids", no_range_check)
    limit = PromptLimit(255, "max_model_len 256, one position kept for output")
    msg = request(prompt_token_ids=[10**9] * 10_000_000)
    with pytest.raises(ValueError) as err:
        frontend.prompt_token_ids(msg, 49152, limit)
    assert str(err.value) == (
        "the prompt has 10000000 tokens; at most 255 prompt tokens are allowed "
        "(max_model_len 256, one position kept for output)"
    )


def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(frontend, monkeypatch):
    longest = frontend.tokenizer.max_token_chars
    assert longest == 81  # SmolLM2's longest vocabulary entry
    limit = PromptLimit(100, "--max-prompt-tokens")
    fits = "a" * (100 * longest)
    with pytest.raises(ValueError, match=r"^the prompt has \d+ tokens; at most 100 prompt"):
        frontend.prompt_token_ids(request(prompt=fits), 49152, limit)  # tokenized, then counted

    def no_tokenizing(*_args, **_kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(frontend.tokenizer, "encode", no_tokenizing)
    with pytest.raises(ValueError) as err:
        frontend.prompt_token_ids(request(prompt=fits + "a"), 49152, limit)
    assert str(err.value) == (
        "the prompt has 8101 characters, more than 100 tokens can hold (the longest token has "
        "81); at most 100 prompt tokens are allowed (--max-prompt-tokens)"
    )


def test_requests_in_flight_are_capped_per_client():
    sent: list = []
    frontend = Frontend(
        None, ServiceMetrics(), send=lambda *m: sent.append(m) or True,
        withdraw=lambda _: None, max_pending_per_client=2,
    )  # fmt: skip

    def accept(client: bytes, rid: str) -> ClientRequest:
        msg = GenerateRequest(PROTOCOL_VERSION, rid, prompt_token_ids=[1])
        return frontend.accept(client, msg, 10, ())

    first, _ = accept(b"a", "a1"), accept(b"a", "a2")
    with pytest.raises(ValueError) as err:
        accept(b"a", "a3")
    assert str(err.value) == (
        "this client already has 2 requests in flight, the most allowed "
        "(--max-pending-per-client 2); wait for one to finish"
    )
    accept(b"b", "b1")  # another client is not affected
    frontend.finish(first, [3], "length", None)
    accept(b"a", "a3")  # a finished request frees its place
    frontend.refuse(frontend.requests["a3"], "no worker")
    frontend._client_gone(b"a")
    assert dict(frontend.pending) == {b"b": 1}
    assert list(frontend.requests) == ["b1"]


# --- resumed requests: a client that lost its control plane sends what it already has --------


def stream_text(frontend: Frontend, req: ClientRequest, ids: list[int]) -> list[str]:
    """The text deltas `req` sends as `ids` arrive one by one (stopping at a stop string)."""
    pieces = []
    for token in ids:
        req.output_token_ids.append(token)
        delta, stopped = frontend.text_delta(req, final=False)
        pieces.append(delta)
        if stopped:
            return pieces
    pieces.append(frontend.text_delta(req, final=True)[0])
    return pieces


@pytest.mark.parametrize("stop", [(), ("本語 🙂 x",), ("zzz", "🙂 d")])
def test_a_resumed_stream_goes_on_with_the_text_it_had_not_sent(stop):
    """Cut the stream after every token: the text sent before the cut, then the text the
    resumed request sends, is exactly the uninterrupted text (held-back text included)."""
    frontend = make_frontend(load_tokenizer("smollm2-135m"))
    tok = frontend.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(" café 日本語 🙂 done", add_special_tokens=False)
    params = SamplingParams(stop=stop, max_tokens=64)

    def fresh() -> ClientRequest:
        return ClientRequest("r", b"c", prompt, params, True, None, 0, None)

    whole = "".join(stream_text(frontend, fresh(), ids))
    for cut in range(1, len(ids)):
        before = fresh()
        sent = "".join(stream_text(frontend, before, ids[:cut])[:cut])  # no final flush
        resume = Resume(ids[:cut], len(sent))
        msg = request(prompt_token_ids=prompt, sampling=params, resume=resume)
        after = frontend.accept(b"c2", msg, 49152, ())
        rest = "".join(stream_text(frontend, after, ids[cut:]))
        frontend.finish(after, [], "length", None)
        assert sent + rest == whole, cut


def test_a_resume_takes_over_the_lost_request_and_only_its_own():
    withdrawn: list[str] = []
    frontend = Frontend(
        None, ServiceMetrics(), send=lambda *_: True, withdraw=lambda r: withdrawn.append(r.client)
    )
    params = SamplingParams(max_tokens=8)

    def accept(client: bytes, key: str = "", resume: Resume | None = None) -> ClientRequest:
        msg = request(prompt_token_ids=[1, 2], sampling=params, resume=resume)
        return frontend.accept(client, msg, 10, (), None, key)

    first = accept(b"old", key="k")
    with pytest.raises(ValueError, match="'r' is already in flight"):
        accept(b"new", key="k")  # not a resume
    with pytest.raises(ValueError, match="8 output tokens already"):
        accept(b"new", key="k", resume=Resume([3] * 8))  # a resume that cannot go on...
    assert frontend.requests["r"] is first and withdrawn == []  # ...leaves the old one be
    with pytest.raises(ValueError, match="'r' is already in flight"):
        accept(b"new", key="other", resume=Resume([3]))  # another client's key
    taken = accept(b"new", key="k", resume=Resume([3, 4]))
    assert withdrawn == [b"old"] and frontend.requests["r"] is taken is not first
    assert taken.output_token_ids == [3, 4] and taken.sent_first
    assert dict(frontend.pending) == {b"new": 1}
    with pytest.raises(AlreadyResumed):
        accept(b"new", key="k", resume=Resume([3, 4]))  # sent again on the same connection
    assert frontend.requests["r"] is taken


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "hi", "resume": Resume([5])}, "the prompt must be prompt_token_ids"),
        ({"prompt_token_ids": [1], "resume": Resume([5] * 8)}, "8 output tokens already"),
        ({"prompt_token_ids": [1], "stream": False, "resume": Resume([5])}, "not streamed"),
        ({"prompt_token_ids": [1], "resume": Resume([49152])}, "resume output token ids"),
    ],
)
def test_a_resume_that_cannot_go_on_is_refused(frontend: Frontend, fields: dict, message: str):
    msg = request(sampling=SamplingParams(max_tokens=8), **fields)
    with pytest.raises(ValueError, match=message):
        frontend.accept(b"c", msg, 49152, ())
    assert "r" not in frontend.requests


def test_a_resume_longer_than_a_worker_can_take_is_refused(frontend: Frontend):
    limit = PromptLimit(10, "max_model_len 11, one position kept for output")
    msg = request(prompt_token_ids=[1] * 6, sampling=SamplingParams(max_tokens=64),
                  resume=Resume([5] * 5))  # fmt: skip
    with pytest.raises(ValueError) as err:
        frontend.accept(b"c", msg, 49152, (), limit)
    assert str(err.value) == (
        "resume: the prompt and its output tokens hold 11 tokens; at most 10 can be taken up "
        "again (max_model_len 11, one position kept for output)"
    )
    assert "r" not in frontend.requests


def test_a_resume_with_nothing_received_is_the_request_again(frontend: Frontend):
    msg = request(prompt="Hello there", resume=Resume([]))
    req = frontend.accept(b"c", msg, 49152, ())
    assert req.prompt_token_ids == frontend.tokenizer.encode("Hello there")
    assert req.output_token_ids == [] and req.sent_first
    frontend.finish(req, [], "abort", None)
