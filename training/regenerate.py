"""Regenerate the assistant turns of chats with the target itself, through specserve's engine.

A drafter is verified against the target's own outputs, so it is trained on them: every user
turn of a chat is answered greedily by the target (batched), turn after turn, with its earlier
answers in the history. Each answered turn becomes one sample: the prompt's token ids (chat
template applied) and the response's, plus the target's hidden states at every position
(`features.py`), recorded by the same forward passes that generated the response. The prefix
cache is off for the run, so that every position of a sample is computed by its own request.

With `answers="dataset"` the training chats keep the data's own answers instead: each answered
turn (its history holding the data's earlier answers) is run through the target once as a
prompt, which records the same rows, so the drafter still learns the target's distribution at
every position, on text the target did not write. A prefill costs a fraction of generating the
answer token by token. Held-out chats are always answered by the target, so that evaluation
measures what serving will see.

A wave of chats is written at once (its shard, then its JSON lines), so a stopped run resumes
at the first wave it had not finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import torch

from specserve.shared.protocol import SamplingParams
from specserve.training.corpus import Chat
from specserve.training.features import FeatureRecorder, SampleRows, write_shard
from specserve.training.progress import Progress

log = structlog.get_logger(__name__)

MIN_RESPONSE_TOKENS = 16  # a prompt leaving less room than this is skipped


class Sample(msgspec.Struct, frozen=True):
    """One answered turn: the target's greedy response to `prompt`, or the data's own answer
    (`by_data`, `--answers dataset`)."""

    chat: str
    turn: int
    held_out: bool
    prompt: list[int]
    response: list[int]
    finish: str
    shard: str  # file under the work dir's shards/ holding the rows
    row: int  # the sample's first row there
    by_data: bool = False  # the response is the data's answer, not the target's

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.response

    @property
    def rows(self) -> SampleRows:
        return SampleRows(self.shard, self.row)


@dataclass(frozen=True)
class RegenerateOptions:
    max_len: int  # prompt + response tokens of one sample
    max_new_tokens: int
    max_turns: int
    concurrency: int  # requests in flight at once
    wave: int  # chats per wave (one engine call per turn of a wave)
    answers: str = "target"  # "target": regenerated; "dataset": the data's own (training chats)
    # seconds: no wave starts that the last one's pace says would end past them (one always runs)
    time_limit: float | None = None
    answer_new: bool = True  # False: only the samples already in the work directory


def read_samples(path: Path) -> list[Sample]:
    """Samples written so far (a torn last line from an interrupted run is dropped)."""
    if not path.is_file():
        return []
    decoder = msgspec.json.Decoder(Sample)
    samples = []
    for line in path.read_bytes().splitlines():
        try:
            samples.append(decoder.decode(line))
        except msgspec.DecodeError:
            break
    return samples


def regenerate(
    llm,  # specserve.LLM with prefix caching off; the caller owns the model
    chats: Sequence[Chat],
    held_out_ids: set[str],
    work_dir: Path,
    layers: Sequence[int],
    options: RegenerateOptions,
) -> list[Sample]:
    """Answer every user turn of `chats` with `llm`, recording the target's hidden states at
    `layers`; samples go to `work_dir/samples.jsonl`, rows to `work_dir/shards/`.

    Chats whose samples are already there are skipped, so calling it again after a stop
    continues the run (samples whose shard is gone get their rows again by a prefill). With
    `options.time_limit` it stops between waves and returns the samples done so far (a later
    call goes on from there).
    """
    recorder = FeatureRecorder(layers)
    llm.engine.runner.recorder = recorder
    try:
        done = _answer_chats(llm, recorder, chats, held_out_ids, work_dir, options)
    finally:
        llm.engine.runner.recorder = None
    wanted = {c.id for c in chats}
    return [s for s in done if s.chat in wanted]


def _answer_chats(
    llm,
    recorder: FeatureRecorder,
    chats: Sequence[Chat],
    held_out_ids: set[str],
    work_dir: Path,
    options: RegenerateOptions,
) -> list[Sample]:
    """`regenerate` with the recorder in place: every sample in the work directory after it."""
    index = work_dir / "samples.jsonl"
    found = read_samples(index)
    done = _keep_or_rebuild(llm, recorder, found, work_dir, options.wave)
    if not options.answer_new and done == found:
        return done  # nothing rebuilt: read only, so runs sharing the directory can train at once
    finished_chats = {s.chat for s in done}
    todo = [c for c in chats if c.id not in finished_chats] if options.answer_new else []
    _rewrite(index, done)  # drops a torn last line before appending
    progress = Progress(
        "regenerating", total=len(chats), unit="chats", initial=len(chats) - len(todo)
    )
    started, last_wave = time.perf_counter(), 0.0
    try:
        with index.open("ab") as out:
            for first in range(0, len(todo), options.wave):
                wave_started = time.perf_counter()
                elapsed = wave_started - started
                if (
                    options.time_limit is not None
                    and first
                    and elapsed + last_wave > options.time_limit
                ):
                    log.info("regenerate.time_limit", chats_left=len(todo) - first, seconds=elapsed)
                    break
                wave = todo[first : first + options.wave]
                own = {c.id for c in wave if options.answers == "dataset"} - held_out_ids
                regenerated = [c for c in wave if c.id not in own]
                answered = _answer_wave(llm, recorder, regenerated, options)
                answered += _prefill_wave(llm, recorder, [c for c in wave if c.id in own], options)
                samples = _save_wave(work_dir, answered, held_out_ids)
                for sample in samples:
                    out.write(msgspec.json.encode(sample) + b"\n")
                out.flush()
                done.extend(samples)
                progress.update(len(wave), tokens=sum(len(s.response) for s in samples))
                last_wave = time.perf_counter() - wave_started
    finally:
        progress.close()
    return done


@dataclass(frozen=True)
class _Answer:
    chat: str
    turn: int
    prompt: list[int]
    response: list[int]
    finish: str
    aux: torch.Tensor
    final: torch.Tensor
    by_data: bool = False


def _save_wave(work_dir: Path, answers: Sequence[_Answer], held_out_ids: set[str]) -> list[Sample]:
    if not answers:
        return []
    name = _next_shard(work_dir)
    firsts = write_shard(
        work_dir / "shards" / name, [(a.prompt + a.response, a.aux, a.final) for a in answers]
    )
    return [
        Sample(
            a.chat,
            a.turn,
            a.chat in held_out_ids,
            a.prompt,
            a.response,
            a.finish,
            name,
            first,
            a.by_data,
        )
        for a, first in zip(answers, firsts, strict=True)
    ]


def _next_shard(work_dir: Path) -> str:
    """A shard name after every one there (never one in use, even where a shard was lost)."""
    taken = [int(p.stem.split("-")[-1]) for p in (work_dir / "shards").glob("wave-*.safetensors")]
    return f"wave-{max(taken, default=-1) + 1:05d}.safetensors"


def _keep_or_rebuild(
    llm, recorder: FeatureRecorder, samples: Sequence[Sample], work_dir: Path, wave: int
) -> list[Sample]:
    """The samples written so far; those whose shard is gone (token ids carried from another
    machine without their rows, or shards deleted to save space) get their rows again from one
    prefill each, into new shards, which costs far less than answering them again."""
    kept: list[Sample] = []
    lost: list[Sample] = []
    for sample in samples:
        (kept if (work_dir / "shards" / sample.shard).is_file() else lost).append(sample)
    if not lost:
        return kept
    progress = Progress("rebuilding rows", total=len(lost), unit="samples")
    for first in range(0, len(lost), wave):
        group = lost[first : first + wave]
        rows = prefill_rows(llm, recorder, [s.token_ids for s in group])
        found = [(s, r) for s, r in zip(group, rows, strict=True) if r is not None]
        if found:
            name = _next_shard(work_dir)
            firsts = write_shard(work_dir / "shards" / name, [(s.token_ids, *r) for s, r in found])
            kept += [
                msgspec.structs.replace(s, shard=name, row=row)
                for (s, _), row in zip(found, firsts, strict=True)
            ]
        progress.update(len(group), tokens=sum(s.num_tokens for s in group))
    progress.close()
    return kept


def prefill_rows(
    llm, recorder: FeatureRecorder, sequences: Sequence[list[int]]
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """The target's rows at every position of each sequence but its last, from one batched
    engine call that runs each as a prompt; None where one failed (logged)."""
    if not sequences:
        return []
    recorder.clear()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    outputs = llm.generate(list(sequences), params)
    rows: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for ids, output in zip(sequences, outputs, strict=True):
        got = recorder.take(output.request_id, len(ids) - 1) if output.error is None else None
        if got is None:
            error = output.error or "hidden states incomplete"
            log.warning("regenerate.prefill_failed", tokens=len(ids), error=error)
        rows.append(got)
    return rows


def _answer_wave(
    llm, recorder: FeatureRecorder, wave: Sequence[Chat], options: RegenerateOptions
) -> list[_Answer]:
    """All turns of one wave of chats: turn k of every chat in one batched engine call."""
    tokenizer = llm.tokenizer
    histories: dict[str, list[dict[str, str]]] = {c.id: [] for c in wave}
    pending = {c.id: list(c.turns) for c in wave}
    answers: list[_Answer] = []
    for turn in range(options.max_turns):
        prompts: list[tuple[str, list[int]]] = []
        for chat in wave:
            messages = _next_prompt(histories[chat.id], pending[chat.id])
            if messages is None:
                continue
            ids = _chat_prompt(tokenizer, messages)
            if len(ids) + MIN_RESPONSE_TOKENS > options.max_len:
                pending[chat.id] = []  # the history outgrew max_len: the chat ends here
                continue
            prompts.append((chat.id, ids))
        if not prompts:
            break
        params = [
            SamplingParams(
                max_tokens=min(options.max_new_tokens, options.max_len - len(ids)),
                temperature=0.0,
            )
            for _, ids in prompts
        ]
        recorder.clear()
        outputs = llm.generate([ids for _, ids in prompts], params)
        for (chat_id, ids), output in zip(prompts, outputs, strict=True):
            response = list(output.token_ids)
            rows = recorder.take(output.request_id, len(ids) + len(response) - 1)
            if output.error is not None or rows is None or not response:
                log.warning(
                    "regenerate.turn_dropped",
                    chat=chat_id,
                    turn=turn,
                    error=output.error or "hidden states incomplete",
                )
                pending[chat_id] = []
                continue
            finish = output.finish_reason or ""
            answers.append(_Answer(chat_id, turn, ids, response, finish, *rows))
            text = tokenizer.decode(response)
            histories[chat_id].append({"role": "assistant", "content": text})
    return answers


def _prefill_wave(
    llm, recorder: FeatureRecorder, wave: Sequence[Chat], options: RegenerateOptions
) -> list[_Answer]:
    """The data's own answers of a wave of chats, each run through the target as one prompt
    (every answered turn of the wave in one batched engine call) to record its rows."""
    tokenizer = llm.tokenizer
    eos = tokenizer.eos_token_ids[0]
    turns: list[tuple[str, int, list[int], list[int], str]] = []
    for chat in wave:
        for turn, (messages, answer) in enumerate(_answered_turns(chat)):
            if turn >= options.max_turns:
                break
            prompt = _chat_prompt(tokenizer, messages)
            room = min(options.max_new_tokens, options.max_len - len(prompt))
            if room < MIN_RESPONSE_TOKENS:
                break  # the history outgrew max_len: the chat ends here
            full = [*tokenizer.encode(answer, add_special_tokens=False), eos]
            finish = "stop" if len(full) <= room else "length"
            turns.append((chat.id, turn, prompt, full[:room], finish))
    rows = prefill_rows(llm, recorder, [prompt + response for _, _, prompt, response, _ in turns])
    return [
        _Answer(chat_id, turn, prompt, response, finish, *got, by_data=True)
        for (chat_id, turn, prompt, response, finish), got in zip(turns, rows, strict=True)
        if got is not None
    ]


def _chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of `messages` through the chat template, ready for the assistant's turn."""
    return tokenizer.encode(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        add_special_tokens=False,
    )


def _answered_turns(chat: Chat) -> Iterable[tuple[list[dict[str, str]], str]]:
    """Each user turn the data answers: the messages up to it (with the data's earlier
    answers) and its answer."""
    history: list[dict[str, str]] = []
    answered = 0
    for role, text in chat.turns:
        history.append({"role": role, "content": text})
        if role != "user":
            continue
        if answered == len(chat.answers):
            return
        yield list(history), chat.answers[answered]
        history.append({"role": "assistant", "content": chat.answers[answered]})
        answered += 1


def _next_prompt(
    history: list[dict[str, str]], pending: list[tuple[str, str]]
) -> list[dict[str, str]] | None:
    """Move turns up to and including the next user turn into `history`; None when done."""
    while pending:
        role, text = pending.pop(0)
        history.append({"role": role, "content": text})
        if role == "user":
            return list(history)
    return None


def _rewrite(path: Path, samples: Iterable[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as out:
        for sample in samples:
            out.write(msgspec.json.encode(sample) + b"\n")
    tmp.replace(path)


def save_json(path: Path, value: object) -> None:
    """Write `value` as indented JSON, atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
