"""Our tokenizer matches transformers' on the bundled GGUF and on a saved Hugging Face dir.

All comparisons are exact: token ids, decoded strings and rendered chat templates.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest

from specserve.shared.gguf_metadata import find_bundled_gguf
from specserve.shared.tokenizer import DetokenizeOffsets, Tokenizer, compile_chat_template

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "héllo 世界 🙂",
    "  leading spaces\n\nnew lines\tand a tab  ",
    "1234567 + 3.14159 = 1234570.14159?!",
    "don't you're WE'LL it's",
    "The quick brown fox's 3 jumps over 12 lazy dogs -- twice!! (really?) #hashtag @user",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><jupyter_code>print('x')",
    "ümlaut Ωmega Ђ ✓✓ 👨‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "",
    " ",
    "\n",
]
CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? Answer in 世界 style 🙂"},
    ],
    "user-only": [{"role": "user", "content": "Hi!"}],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
}


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return find_bundled_gguf()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def hf_dir(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF tokenizer as transformers saves it, plus a generation config with two stops."""
    path = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.decode([1, 9690, 2]) == "system"


def test_special_ids_match_transformers(ours: Tokenizer, hf: Any) -> None:
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert ours.vocab_size == len(hf) == 49152


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_template_matches_transformers(ours: Tokenizer, hf: Any, name: str) -> None:
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected
    no_prompt = hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == no_prompt
    assert expected.endswith("<|im_start|>assistant\n")


def _stream(tok: Tokenizer, ids: list[int], start: DetokenizeOffsets, final: bool) -> list[str]:
    offsets, pieces = start, []
    for end in range(start.read_offset + 1, len(ids) + 1):
        piece, offsets = tok.decode_incremental(ids[:end], offsets, final=final and end == len(ids))
        pieces.append(piece)
    return pieces


@pytest.mark.parametrize("text", [*TEXTS, "😀" * 7 + " naïve café, 東京タワー!"])
def test_incremental_decode_reproduces_full_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    pieces = _stream(ours, ids, DetokenizeOffsets(), final=True)
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_decode_holds_split_characters(ours: Tokenizer) -> None:
    ids = ours.encode("x🦩y 𝔘")
    # The emoji's four bytes are spread over several byte-level tokens: guard that the test
    # really exercises a character split across tokens.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    pieces = _stream(ours, ids, DetokenizeOffsets(), final=False)
    assert "".join(pieces) == "x🦩y 𝔘"
    assert "" in pieces  # some step had only part of the emoji and emitted nothing


def test_incremental_decode_after_prompt(ours: Tokenizer) -> None:
    prompt = ours.encode("<|im_start|>user\nSay hi in Japanese<|im_end|>\n<|im_start|>assistant\n")
    completion = ours.encode("こんにちは 🙂!<|im_end|>")
    ids = prompt + completion
    pieces = _stream(ours, ids, Tokenizer.stream_offsets(prompt), final=True)
    assert "".join(pieces) == "こんにちは 🙂!"


def test_incremental_decode_final_flushes_partial_character(ours: Tokenizer) -> None:
    ids = ours.encode("ok🦩")
    cut = next(n for n in range(1, len(ids)) if ours.decode(ids[:n]).endswith("\ufffd"))
    held = _stream(ours, ids[:cut], DetokenizeOffsets(), final=False)
    flushed = _stream(ours, ids[:cut], DetokenizeOffsets(), final=True)
    assert "".join(held) == "ok"
    assert "".join(flushed) == ours.decode(ids[:cut])


@pytest.fixture(scope="module")
def from_dir(hf_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(hf_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_dir_round_trip(from_dir: Tokenizer, hf: Any, text: str) -> None:
    assert from_dir.encode(text) == hf.encode(text)
    assert from_dir.decode(from_dir.encode(text), skip_special_tokens=False) == text


def test_hf_dir_specials_and_template(from_dir: Tokenizer, hf: Any) -> None:
    tok = from_dir
    assert tok.eos_token_ids == (2, 0)  # generation_config first, then the tokenizer's eos
    assert tok.bos_token_id == 1
    for messages in CONVERSATIONS.values():
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(messages) == expected


def test_hf_dir_template_inside_tokenizer_config(hf_dir: Path, hf: Any, tmp_path: Path) -> None:
    """Older checkpoints keep the template in tokenizer_config.json, possibly as a named list."""
    shutil.copytree(hf_dir, tmp_path, dirs_exist_ok=True)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "unused"},
        {"name": "default", "template": template},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    messages = CONVERSATIONS["system+user"]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == expected
    assert tok.eos_token_ids == (2,)


TEMPLATE_FEATURES = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ loop.index }}/{{ ns.count }}] {{ message | tojson }}
{% endfor %}
{%- if add_generation_prompt %}
GO {{ eos_token }}{{ extra }}
{% endif %}"""


def test_custom_template_features_match_transformers(ours: Tokenizer, hf: Any) -> None:
    """Whitespace control, namespace, loop controls, tojson and special-token variables."""
    messages = [
        {"role": "user", "content": 'quote " and <tag> & é'},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok"},
    ]
    custom = Tokenizer(ours.backend, ours.special, TEMPLATE_FEATURES)
    expected = hf.apply_chat_template(
        messages,
        chat_template=TEMPLATE_FEATURES,
        add_generation_prompt=True,
        tokenize=False,
        extra="!",
    )
    assert custom.apply_chat_template(messages, extra="!") == expected
    assert "hidden" not in expected and "<|im_end|>" in expected


def test_template_helpers_and_sandbox() -> None:
    assert compile_chat_template("{{ strftime_now('%Y') }}").render() == str(datetime.now().year)
    assert compile_chat_template("{{ x | tojson }}").render(x={"a": "<é>"}) == '{"a": "<é>"}'
    assert compile_chat_template("{% generation %}hi{% endgeneration %}").render() == "hi"
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        compile_chat_template("{{ raise_exception('bad role') }}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()


def test_missing_template_is_an_error(ours: Tokenizer) -> None:
    bare = Tokenizer(ours.backend, ours.special, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
