import msgspec
import pytest

from specserve.shared import protocol as p


def _decode_batch(n: int, k: int) -> p.StepBatch:
    return p.StepBatch(
        version=p.PROTOCOL_VERSION,
        step_id=123456,
        running=[
            p.RunningDelta(
                handle=10_000 + i,
                num_computed_tokens=3000 + i,
                num_scheduled_tokens=1 + k,
                num_spec_tokens=k,
            )
            for i in range(n)
        ],
    )


def test_round_trip_of_every_message_kind():
    sampling = p.SamplingParams(max_tokens=8, temperature=0.0, seed=3, stop_token_ids=(2, 5))
    batch = p.StepBatch(
        version=p.PROTOCOL_VERSION,
        step_id=1,
        new_requests=[
            p.NewRequest(
                handle=0,
                request_id="r0",
                token_ids=[1, 2, 3],
                num_prompt_tokens=3,
                sampling=sampling,
                block_ids=[[1], [2]],
                num_computed_tokens=0,
                num_scheduled_tokens=3,
            )
        ],
        running=[p.RunningDelta(1, 16, 4, [[7], [8]], 3)],
        preempted=[2],
        finished=[3],
    )
    assert p.decode(p.encode(batch)) == batch
    result = p.StepResult(
        version=p.PROTOCOL_VERSION,
        step_id=1,
        results=[
            p.RequestResult(0, [9], [1, 2, 3], p.TokenLogprobs([-0.5], [[9, 4]], [[-0.5, -1.5]])),
            p.RequestResult(1, [], error="boom"),
        ],
    )
    assert p.decode(p.encode(result)) == result


def test_a_step_of_256_decoding_requests_is_a_few_kilobytes():
    # 256 requests verifying 4 drafts each, with realistic handles and positions: ~10 bytes each.
    size = len(p.encode(_decode_batch(256, 4)))
    assert size == 2639, size  # 10 bytes per request + 79 bytes of envelope
    assert len(p.encode(_decode_batch(256, 0))) == 2639


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\xc1", "malformed frame"),
        (b"not msgpack at all", "malformed frame"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed frame"),
        (msgspec.msgpack.encode({"type": "hello", "version": 1}), "unknown message type 'hello'"),
        (
            msgspec.msgpack.encode({"type": "step", "version": 99, "step_id": 1}),
            "unsupported protocol version 99",
        ),
        (msgspec.msgpack.encode({"type": "step", "step_id": 1}), "malformed 'step' message"),
        (
            msgspec.msgpack.encode({"type": "step", "version": 1, "step_id": "x"}),
            "Expected `int`, got `str`",
        ),
        (
            msgspec.msgpack.encode({"type": "step", "version": 1, "step_id": 1, "extra": 1}),
            "unknown field `extra`",
        ),
        (
            msgspec.msgpack.encode(
                {"type": "result", "version": 1, "step_id": 1, "results": [[1, "x"]]}
            ),
            "malformed 'result' message",
        ),
    ],
)
def test_malformed_or_unknown_frames_raise_a_clear_protocol_error(frame, message):
    with pytest.raises(p.ProtocolError, match=message.replace("(", r"\(")):
        p.decode(frame)


def test_version_mismatch_in_a_well_formed_message():
    frame = p.encode(p.StepBatch(version=2, step_id=1))
    with pytest.raises(p.ProtocolError, match="unsupported protocol version 2"):
        p.decode(frame)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 2.0}, "min_p must be in"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in"),
        ({"seed": -1}, "seed must be in"),
        ({"logprobs": 21}, "logprobs must be in"),
    ],
)
def test_impossible_sampling_parameters_are_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        p.SamplingParams(**params).validate()


def test_stop_tokens_outside_the_vocabulary_are_rejected():
    p.SamplingParams(stop_token_ids=(1, 2)).validate(vocab_size=10)
    with pytest.raises(ValueError, match=r"stop_token_ids \[10\] are outside the vocabulary"):
        p.SamplingParams(stop_token_ids=(1, 10)).validate(vocab_size=10)


def _generate_with(extra: dict[str, bytes]) -> bytes:
    """A `generate` map whose `extra` values are spliced in raw, after the usual fields."""
    enc = msgspec.msgpack.encode
    fields = {"type": enc("generate"), "version": enc(1), "request_id": enc("r")} | extra
    return bytes([0x80 | len(fields)]) + b"".join(enc(k) + v for k, v in fields.items())


NESTED = b"\x91" * 1000 + b"\xc0"  # [[[...[nil]...]]]: 1001 bytes, 1000 levels


@pytest.mark.parametrize(
    ("frame", "request_id"),
    [
        (_generate_with({"prompt_token_ids": NESTED}), "r"),
        (_generate_with({"junk": NESTED}), "r"),  # the header diagnosis would have skipped it
        (NESTED, None),
        (b"\x81" + msgspec.msgpack.encode("x") + NESTED, None),  # so would the tag lookup
    ],
)
def test_a_deeply_nested_frame_is_a_protocol_error_not_a_recursion_error(frame, request_id):
    with pytest.raises(p.ProtocolError) as err:
        p.decode(frame)
    assert err.value.request_id == request_id  # the refusal can fail that request
    assert str(err.value) == f"frame refused ({len(frame)} bytes): nested deeper than 32 levels"


def test_limits_on_depth_and_objects_are_the_callers():
    frame = p.encode(p.GenerateRequest(1, "r", prompt_token_ids=list(range(100))))
    objects = 1 + 14 + 14 + 100  # the map, its 14 keys and 14 values, the 100 ids
    assert p.decode(frame, max_items=objects).prompt_token_ids == list(range(100))
    refused = rf"^frame refused \({len(frame)} bytes\): "
    with pytest.raises(p.ProtocolError, match=refused + "more than 128 objects in one frame$"):
        p.decode(frame, max_items=objects - 1)
    with pytest.raises(p.ProtocolError, match=refused + "nested deeper than 1 levels$"):
        p.decode(frame, max_depth=1)


def test_array_structs_refuse_extra_elements():
    enc = msgspec.msgpack.encode
    frame = enc(
        {
            "type": "result",
            "version": 1,
            "step_id": 1,
            "results": [[1, [2], None, None, None, None, 0, "extra"]],
        }
    )
    message = r"^malformed 'result' message: Expected `array` of at most length 7, got 8"
    with pytest.raises(p.ProtocolError, match=message):
        p.decode(frame)


def test_a_refused_generate_frame_names_its_request():
    enc = msgspec.msgpack.encode
    bad_type = enc({"type": "generate", "version": 1, "request_id": "x1", "prompt_token_ids": "a"})
    with pytest.raises(p.ProtocolError, match="malformed 'generate' message") as err:
        p.decode(bad_type)
    assert err.value.request_id == "x1"
    future = p.encode(p.GenerateRequest(7, "x2", prompt_token_ids=[1]))
    with pytest.raises(p.ProtocolError, match="unsupported protocol version 7") as err:
        p.decode(future)
    assert err.value.request_id == "x2"
    abort = enc({"type": "abort", "version": 1, "request_id": 5})
    with pytest.raises(p.ProtocolError) as err:
        p.decode(abort)
    assert err.value.request_id is None


def test_a_map_key_that_is_not_utf8_is_a_protocol_error():
    """msgspec raises UnicodeDecodeError for such a key (worded "'utf-8' codec ..." up to 0.22,
    "Invalid UTF-8 encoded string" from 0.23); found by tests/service/test_fuzz_frames."""
    enc = msgspec.msgpack.encode
    frame = enc({"type": "generate", "version": 1, "request_id": "u1", "prompt_token_ids": [1]})
    bad_key = frame.replace(b"prompt_token_ids", b"prompt\xc1token_ids")
    utf8 = r"('utf-8' codec|Invalid UTF-8)"
    with pytest.raises(p.ProtocolError, match=rf"^malformed 'generate' message: {utf8}") as err:
        p.decode(bad_key)
    assert err.value.request_id == "u1"
    bad_type = msgspec.msgpack.encode({"type": "result", "version": 1}).replace(
        b"result", b"res\xdflt"
    )
    with pytest.raises(p.ProtocolError, match=r"^malformed frame \(22 bytes\): not a specserve"):
        p.decode(bad_type)


def _schema_depth(info: msgspec.inspect.Type) -> int:
    """How many containers the deepest value of a type nests (a struct or a list is one)."""
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        return max(_schema_depth(t) for t in info.types)
    if isinstance(info, mi.StructType):
        return 1 + max([_schema_depth(f.type) for f in info.fields], default=0)
    if isinstance(info, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return 1 + _schema_depth(info.item_type)
    if isinstance(info, mi.TupleType):
        return 1 + max([_schema_depth(t) for t in info.item_types], default=0)
    assert not isinstance(info, mi.DictType | mi.AnyType), "unbounded nesting in a message"
    return 0


def test_no_message_nests_deeper_than_the_decoders_fast_path_assumes():
    """`decode` trusts msgspec with a frame at once where the caller's depth limit is at least
    DEEPEST_MESSAGE: that holds only while no message type can nest deeper."""
    assert _schema_depth(msgspec.inspect.type_info(p.Message)) == p.DEEPEST_MESSAGE
    lp = p.TokenLogprobs([0.5], [[1, 2]], [[-0.1, -0.2]])
    deepest = p.OutputBatch(1, [p.RequestOutput(1, "r", [1], logprobs=[lp])])
    frame = p.encode(deepest)
    assert p.decode(frame) == deepest
    refused = rf"^frame refused \({len(frame)} bytes\): nested deeper than 6 levels$"
    with pytest.raises(p.ProtocolError, match=refused):
        p.decode(frame, max_depth=p.DEEPEST_MESSAGE - 1)


def test_a_frame_that_fails_the_fast_decode_is_explained_as_before():
    """Without an object budget msgspec goes first; a frame it refuses is still walked and
    diagnosed, with the same words as where the walk goes first."""
    good = p.encode(p.RequestOutput(1, "r", [1, 2]))
    for frame in (good[:-1], good + b"\xc0", b"\xc1"):
        with pytest.raises(p.ProtocolError) as fast:
            p.decode(frame)
        with pytest.raises(p.ProtocolError) as walked:
            p.decode(frame, max_items=1 << 20)
        assert str(fast.value) == str(walked.value)
