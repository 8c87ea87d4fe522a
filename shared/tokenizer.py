"""Tokenizer for the worker: encode/decode, streaming detokenization and chat templates.

Wraps the `tokenizers` library so a checkpoint tokenizes the same way whether it comes as a
Hugging Face directory or as a GGUF file (whose vocabulary and merges live in its metadata).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import structlog
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from specserve.shared.gguf_metadata import GgufMetadata, find_bundled_gguf, read_metadata

log = structlog.get_logger(__name__)

# llama.cpp token types (`tokenizer.ggml.token_type`).
_CONTROL = 3
_USER_DEFINED = 4
# Tokens kept ahead of the unread ones when streaming, so byte-level merges see their left context.
_STREAM_CONTEXT = 5
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokenizeOffsets:
    """Where streaming detokenization stands in a growing list of token ids.

    `prefix_offset..read_offset` is text already emitted, re-decoded as left context;
    everything from `read_offset` on has not been emitted yet.
    """

    prefix_offset: int = 0
    read_offset: int = 0


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Special token strings the chat template may reference, and their ids."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def template_vars(self) -> dict[str, str]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: value for name in names if (value := getattr(self, name)) is not None}


class Tokenizer:
    """A checkpoint's tokenizer plus its chat template and stop tokens."""

    def __init__(
        self, backend: Backend, special: SpecialTokens, chat_template: str | None = None
    ) -> None:
        self.backend = backend
        self.special = special
        self.chat_template = chat_template

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and friends as written by `save_pretrained` or found on the Hub."""
        root = Path(path)
        backend = Backend.from_file(str(root / "tokenizer.json"))
        tok_config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        def token(name: str) -> str | None:
            value = tok_config.get(name)
            return value.get("content") if isinstance(value, Mapping) else value

        bos, eos = token("bos_token"), token("eos_token")
        eos_ids = _unique_ids(
            gen_config.get("eos_token_id"),
            model_config.get("eos_token_id"),
            backend.token_to_id(eos) if eos is not None else None,
        )
        bos_id = backend.token_to_id(bos) if bos is not None else None
        if bos_id is None:
            bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        special = SpecialTokens(
            bos_token=bos,
            eos_token=eos,
            unk_token=token("unk_token"),
            pad_token=token("pad_token"),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
        )
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(tok_config.get("chat_template"))
        return cls(backend, special, template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer that a GGUF file describes in its metadata."""
        meta = read_metadata(path)
        backend = build_gguf_backend(meta)
        tokens: list[str] = meta.fields["tokenizer.ggml.tokens"]

        def token_at(key: str) -> tuple[str | None, int | None]:
            index = meta.get(f"tokenizer.ggml.{key}")
            return (tokens[index], int(index)) if index is not None else (None, None)

        bos, bos_id = token_at("bos_token_id")
        eos, eos_id = token_at("eos_token_id")
        extra_stops = [token_at(key)[1] for key in ("eot_token_id", "eom_token_id")]
        special = SpecialTokens(
            bos_token=bos,
            eos_token=eos,
            unk_token=token_at("unknown_token_id")[0],
            pad_token=token_at("padding_token_id")[0],
            bos_token_id=bos_id,
            eos_token_ids=_unique_ids(eos_id, *extra_stops),
        )
        return cls(backend, special, meta.get("tokenizer.chat_template"))

    # ---- basic API ----------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self.special.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.special.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more of a text, so a text
        longer than `n * max_token_chars` cannot encode to n tokens or fewer."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """A user's prompt as the model sees it: plain, or as one user turn of the chat template
        (whose text already holds its special tokens, so none are added again)."""
        if not chat:
            return self.encode(prompt)
        turn = [{"role": "user", "content": prompt}]
        text = self.apply_chat_template(turn, add_generation_prompt=True)
        return self.encode(text, add_special_tokens=False)

    # ---- streaming ----------------------------------------------------------------------

    @staticmethod
    def stream_offsets(prompt_ids: Sequence[int]) -> DetokenizeOffsets:
        """Offsets to stream a completion after `prompt_ids` (the prompt is never emitted)."""
        n = len(prompt_ids)
        return DetokenizeOffsets(prefix_offset=max(n - _STREAM_CONTEXT, 0), read_offset=n)

    def decode_incremental(
        self,
        ids: Sequence[int],
        offsets: DetokenizeOffsets,
        skip_special_tokens: bool = True,
        final: bool = False,
    ) -> tuple[str, DetokenizeOffsets]:
        """Text completed since `offsets`, given every token id so far.

        The window is re-decoded from `prefix_offset` so that byte-level tokens are joined before
        UTF-8 decoding; a trailing U+FFFD means a character's bytes are still arriving, so
        nothing is emitted until it completes (or `final` forces it out at end of stream).
        """
        ids = list(ids)
        prefix = self.decode(ids[offsets.prefix_offset : offsets.read_offset], skip_special_tokens)
        full = self.decode(ids[offsets.prefix_offset :], skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            return full[len(prefix) :], DetokenizeOffsets(offsets.read_offset, len(ids))
        return "", offsets

    # ---- chat template ------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the checkpoint's Jinja chat template into the prompt text."""
        if self.chat_template is None:
            raise ValueError("this checkpoint ships no chat template")
        template = compile_chat_template(self.chat_template)
        variables = {**self.special.template_vars(), **kwargs}
        return template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


# ---- GGUF tokenizer construction --------------------------------------------------------


def build_gguf_backend(meta: GgufMetadata) -> Backend:
    """Byte-level BPE with GPT-2 pre-tokenization, special tokens and BOS/EOS policy from GGUF."""
    model_type = meta.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {model_type!r} (only byte-level 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in (None, "default", "gpt2", "gpt-2", "smollm"):
        log.warning("tokenizer.gguf.pre_tokenizer_assumed_gpt2", pre=pre)

    tokens: list[str] = meta.fields["tokenizer.ggml.tokens"]
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    byte_chars = _byte_chars()
    # The byte-level vocabulary spells every byte as a printable character; a token stored in
    # plain text is respelled so the BPE model can find it.
    vocab = {
        token if set(token) <= alphabet else "".join(byte_chars[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [_split_merge(merge) for merge in meta.get("tokenizer.ggml.merges") or []]
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False)
    )
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, trim_offsets=True, use_regex=True
    )
    backend.decoder = decoders.ByteLevel()

    # Control tokens spelled outside the byte alphabet are mislabelled vocabulary; adding them
    # would grow the vocabulary past the embedding table.
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, kinds, strict=True)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, kinds, strict=True)
        if kind == _USER_DEFINED and token in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    backend.post_processor = _bos_eos_processor(meta, tokens)
    return backend


def _bos_eos_processor(meta: GgufMetadata, tokens: list[str]) -> processors.TemplateProcessing:
    """Post-processor adding BOS/EOS only when the GGUF asks for them."""
    special: list[tuple[str, int]] = []
    before: list[str] = []
    after: list[str] = []
    for flag, key, side in (
        ("add_bos_token", "bos_token_id", before),
        ("add_eos_token", "eos_token_id", after),
    ):
        index = meta.get(f"tokenizer.ggml.{key}")
        if meta.get(f"tokenizer.ggml.{flag}", False) and index is not None:
            side.append(tokens[index])
            special.append((tokens[index], int(index)))
    single = [*before, "$A:0", *after]
    pair = [*single, *before, "$B:1", *after]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


@lru_cache(maxsize=1)
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table (index = byte value)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed BPE merge {merge!r}")
    return left, right


# ---- chat template rendering ------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (used for training masks) as a no-op."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping: prompts are not HTML."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox: templates ship with checkpoints and are untrusted."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---- helpers ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def _pick_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of named templates of which 'default' is used."""
    if value is None or isinstance(value, str):
        return value
    named = {item["name"]: item["template"] for item in value}
    return named.get("default", next(iter(named.values()), None))


def _unique_ids(*values: int | Iterable[int] | None) -> tuple[int, ...]:
    """Flatten int/list/None values into unique ids, first occurrence first."""
    out: list[int] = []
    for value in values:
        items = [] if value is None else [value] if isinstance(value, int) else list(value)
        for item in items:
            if int(item) not in out:
                out.append(int(item))
    return tuple(out)


BUNDLED_MODELS = ("smollm2-135m",)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of a bundled model name or checkpoint directory (None: it ships none).

    Torch-free, so the control plane can tokenize without loading weights.
    """
    if model in BUNDLED_MODELS:
        return Tokenizer.from_gguf(find_bundled_gguf())
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
            "nor a checkpoint directory"
        )
    return Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
