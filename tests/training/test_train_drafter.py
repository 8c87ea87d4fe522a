"""`specserve train-drafter` on a tiny random chat model: regeneration, training, export,
serving equivalence, resume, bad input, and acceptance through the real runner."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafter_reference import Dims, borrowed_head_logits, dflash_dense, eagle3_dense
from safetensors.torch import load_file

import specserve
from specserve.training.corpus import CorpusError
from specserve.training.dflash import DFlashTrainee
from specserve.training.eagle3 import Eagle3Trainee
from specserve.training.evaluate import measure
from specserve.training.features import ShardReader
from specserve.training.pipeline import TrainDrafterArgs, train_drafter
from specserve.training.regenerate import read_samples
from specserve.training.trainer import (
    STATE_FILE,
    Metrics,
    StepSums,
    TrainConfig,
    Trainer,
    build_trainee,
    collate,
)
from specserve.worker.attention.base import SequenceStep
from specserve.worker.loader import load_model
from specserve.worker.model_runner import forward_step
from specserve.worker.spec_decode.dflash import load_dflash
from specserve.worker.spec_decode.eagle3 import load_eagle3

torch.set_num_threads(1)
LAYERS = (1, 3, 4)  # aux_layers_for(8): low, middle, high
PROMPTS = [
    "Name three rivers.",
    "Count to five.",
    "What is a cat?",
    "Say hello twice.",
    "List some colours.",
    "Describe the sea.",
    "Spell the word tree.",
    "Give me a number.",
    "Why is the sky blue?",
    "Write one short line.",
]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _args(method: str, target: Path, data: Path, out: Path, **changes) -> TrainDrafterArgs:
    base = TrainDrafterArgs(
        method=method,
        model=str(target),
        out=out,
        data=str(data),
        max_samples=len(PROMPTS),
        held_out=0,
        eval_samples=0,
        max_len=96,
        max_new_tokens=40,
        max_turns=1,
        concurrency=4,
        epochs=200.0,
        steps=120,
        lr=3e-3,
        warmup_steps=5,
        batch_tokens=100_000,  # every sample in every step
        checkpoint_every=1000,
        num_spec_tokens=4 if method == "eagle3" else 3,
        draft_vocab_size=1024,
        num_layers=2,
        max_anchors=16,
        bf16=False,
        threads=1,
    )
    return replace(base, **changes)


@pytest.fixture(scope="module")
def regenerated(chat_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Samples and features of the prompts, made by a zero-step EAGLE-3 run."""
    out = tmp_path_factory.mktemp("regenerated")
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    train_drafter(_args("eagle3", chat_target, data, out / "drafter", work_dir=out, steps=1))
    return out


def test_regeneration_is_the_targets_greedy_output_and_hidden_states(
    chat_target: Path, regenerated: Path
) -> None:
    samples = read_samples(regenerated / "samples.jsonl")
    assert len(samples) == len(PROMPTS)
    llm = specserve.LLM(str(chat_target))
    params = specserve.SamplingParams(max_tokens=40, temperature=0.0)
    outputs = llm.generate([s.prompt for s in samples], params)
    assert [s.response for s in samples] == [list(o.token_ids) for o in outputs]
    _assert_rows_are_the_targets(
        load_model(chat_target), ShardReader(regenerated / "shards"), samples[:3]
    )


def _assert_rows_are_the_targets(model, reader: ShardReader, samples) -> None:
    """Each sample's stored rows are the target's hidden states over its tokens (within the
    shard's float16 rounding), and the last token, never run, has none."""
    for sample in samples:
        tokens, aux, final = reader.rows(sample.rows, sample.num_tokens)
        assert tokens.tolist() == sample.token_ids
        want_final, want_aux = _forward(model, tokens[:-1], LAYERS)
        torch.testing.assert_close(aux[:-1], want_aux, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(final[:-1], want_final, atol=2e-3, rtol=1e-3)
        assert not aux[-1].any() and not final[-1].any()


def _forward(model, tokens: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    from specserve.worker.kv_cache import PagedKVCache

    c, n, bs = model.config, tokens.shape[0], 4
    blocks = -(-n // bs)
    cache = PagedKVCache(
        c.kv_groups, blocks + 1, bs, c.num_kv_heads, c.head_dim, model.dtype, "cpu"
    )
    tables = [list(range(1, blocks + 1))] * len(c.kv_groups)
    meta = model.backend.build_metadata([SequenceStep(n, n, tables)], c.kv_groups, bs, "cpu")
    final, aux = forward_step(model, tokens, torch.arange(n), meta, cache, layers)
    return final, torch.cat(aux, dim=-1)


def _trainer(method: str, chat_target: Path, regenerated: Path, out: Path, **changes) -> Trainer:
    model = load_model(chat_target)
    samples = read_samples(regenerated / "samples.jsonl")
    config = TrainConfig(
        method=method,
        aux_layers=LAYERS,
        epochs=100.0,
        max_steps=None,
        lr=3e-3,
        warmup_steps=1,
        batch_tokens=100_000,
        seed=0,
        checkpoint_every=1000,
        num_spec_tokens=4 if method == "eagle3" else 3,
        draft_vocab_size=1024,
        num_layers=2,
        max_anchors=16,
        decay_gamma=2.0,
        mask_token_id=16,
        bf16=False,
    )
    config = replace(config, **changes)
    trainee = build_trainee(config, model, samples)
    out.mkdir(parents=True, exist_ok=True)
    return Trainer(config, trainee, model.config, samples, ShardReader(regenerated / "shards"), out)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_training_steps_lower_the_loss(
    method: str, chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    trainer = _trainer(method, chat_target, regenerated, tmp_path)
    batch = trainer.train[:6]
    seed_state = trainer.generator.get_state()

    def loss() -> float:
        trainer.generator.set_state(seed_state)  # the same DFlash anchors each time
        m = trainer.evaluate(batch)
        return m.loss / m.weight

    before = loss()
    for _ in range(10):
        trainer.optimizer_step(batch)
    after = loss()
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_padded_batch_is_its_samples_one_by_one(
    method: str, chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    """Micro-batches pad samples of several lengths into one forward pass: the loss, loss
    weight and per-position rows and hits are those of the samples run alone (DFlash drawing
    the same anchors), and the gradient of a step does not depend on how it is cut."""
    trainer = _trainer(method, chat_target, regenerated, tmp_path)
    samples = trainer.train[:6]
    assert len({s.num_tokens for s in samples}) > 1
    trainer.generator.manual_seed(3)
    sums = StepSums()
    loss = trainer.batch_loss(collate(trainer.reader, samples), sums)
    found = sums.metrics()
    trainer.generator.manual_seed(3)
    alone, total = Metrics(), torch.zeros(())
    for sample in samples:
        total = total + trainer.sample_loss(sample, alone)
    assert loss is not None
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-4)
    assert found.rows == alone.rows and found.correct == alone.correct
    assert found.weight == pytest.approx(alone.weight) and found.loss == pytest.approx(alone.loss)

    def gradient(micro_tokens: int) -> list[torch.Tensor]:
        cut = _trainer(method, chat_target, regenerated, tmp_path / str(micro_tokens),
                       micro_batch_tokens=micro_tokens)  # fmt: skip
        cut.optimizer.step = lambda: None  # type: ignore[method-assign]
        cut.generator.manual_seed(5)
        cut.optimizer_step(samples)
        return [p.grad.clone() for p in cut.trainee.parameters() if p.grad is not None]

    whole = gradient(100_000)
    if method == "eagle3":  # DFlash's anchors follow the micro-batches' order
        for a, b in zip(whole, gradient(1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_eagle3_accuracy_counts_response_tokens_outside_the_draft_vocabulary_as_misses(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    """Serving never accepts a token the draft vocabulary lacks, so the accuracy's denominator
    is every response row; the loss (and its weight) keeps the rows whose label it holds."""
    trainer = _trainer("eagle3", chat_target, regenerated, tmp_path, draft_vocab_size=32)
    trainee = trainer.trainee
    sample = trainer.train[0]
    tokens, aux, final = trainer.reader.rows(sample.rows, sample.num_tokens)
    with torch.no_grad():
        _, stats = trainee.sequence_loss(tokens, aux, final, len(sample.prompt), 3)
    n, prompt_len = len(tokens), len(sample.prompt)
    for step in range(3):
        labels = tokens[max(prompt_len, step + 2) : n]  # row p predicts token p + 2 + step
        in_vocab = int(trainee.t2d[labels].sum())
        assert stats.rows[step] == len(labels) and stats.loss_rows[step] == in_vocab
        assert stats.correct[step] <= in_vocab
    assert 0 < stats.loss_rows[0] < stats.rows[0]  # 32 ids leave some of the response out
    metrics = trainer.evaluate([sample])
    assert metrics.rows[0] == stats.rows[0] and metrics.weight == stats.loss_rows[0]


def test_trained_eagle3_is_what_serving_and_the_reference_compute(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    """The exported drafter, loaded by the serving loader, gives the training forward's logits
    at every TTT step, and so does the dense reference written from EAGLE-3's equations."""
    trainer = _trainer("eagle3", chat_target, regenerated, tmp_path)
    for _ in range(3):
        trainer.optimizer_step(trainer.train)
    trainer.export()
    trainee = trainer.trainee
    assert isinstance(trainee, Eagle3Trainee)
    exported = load_file(tmp_path / "model.safetensors")
    trainee.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in exported.items()}
    )
    sample = trainer.train[0]
    tokens, aux, final = trainer.reader.rows(sample.rows, sample.num_tokens)
    captured: list[torch.Tensor] = []
    head = trainee.lm_head.forward
    trainee.lm_head.forward = lambda x: captured.append(head(x)) or captured[-1]  # type: ignore[method-assign]
    trainee.sequence_loss(tokens, aux, final, len(sample.prompt), 4)
    first = max(0, len(sample.prompt) - 1 - 4)  # where steps >= 1 start (sequence_loss)

    model = load_model(chat_target)
    drafter = load_eagle3(tmp_path, model)
    weights = {k: v.float() for k, v in exported.items()}
    config = json.loads((tmp_path / "config.json").read_text())
    dims = Dims.of(config)
    embed = model.embed_tokens.weight
    ids_of = drafter.draft_to_target
    for p in (first + 1, sample.num_tokens - 6):
        # Serving: step 0 over rows 0..p with target features, then 3 chained steps.
        table = [list(range(1, 64))]
        cache = drafter.make_kv_cache(64, 4)
        meta = drafter.build_attn_metadata([SequenceStep(p + 1, p + 1, table)], 4, "cpu")
        fused = drafter.combine_hidden_states(aux[: p + 1])
        normed, pre = drafter(tokens[1 : p + 2], fused, torch.arange(p + 1), meta, cache)
        outputs = [drafter.compute_logits(normed[-1:])[0, ids_of]]
        feed = pre[-1:]
        ref_ids, ref_hidden = tokens[1 : p + 2], fused
        for j in range(1, 4):
            meta = drafter.build_attn_metadata([SequenceStep(1, p + j + 1, table)], 4, "cpu")
            ids = tokens[p + 1 + j : p + 2 + j]
            ref_ids, ref_hidden = torch.cat([ref_ids, ids]), torch.cat([ref_hidden, feed])
            normed, feed = drafter(ids, feed, torch.tensor([p + j]), meta, cache)
            outputs.append(drafter.compute_logits(normed)[0, ids_of])
            ref_normed, _ = eagle3_dense(weights, 1, False, embed, ref_ids, ref_hidden, dims)
            reference = ref_normed[-1] @ weights["lm_head.weight"].T
            torch.testing.assert_close(outputs[-1], reference, atol=2e-4, rtol=1e-4)
        for j, got in enumerate(outputs):  # the training rows start at `first`
            torch.testing.assert_close(got, captured[j][0, p - first], atol=2e-4, rtol=1e-4)


def test_trained_dflash_is_what_serving_and_the_reference_compute(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    trainer = _trainer("dflash", chat_target, regenerated, tmp_path)
    for _ in range(3):
        trainer.optimizer_step(trainer.train)
    trainer.export()
    trainee = trainer.trainee
    assert isinstance(trainee, DFlashTrainee)
    sample = trainer.train[0]
    tokens, aux, _ = trainer.reader.rows(sample.rows, sample.num_tokens)
    model = load_model(chat_target)
    drafter = load_dflash(tmp_path, model)
    weights = {k: v.float() for k, v in load_file(tmp_path / "model.safetensors").items()}
    dims = Dims.of(json.loads((tmp_path / "config.json").read_text()))
    trainee.load_state_dict({k: v for k, v in weights.items()})  # the exported (bf16) values
    for anchor in (len(sample.prompt), sample.num_tokens - 3):
        block = torch.tensor([int(tokens[anchor])] + [16] * 3)
        # Serving: context K/V of rows < anchor, then the block.
        cache = drafter.make_kv_cache(64, 4)
        table = list(range(1, 64))
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(anchor)])
        context = drafter.combine_hidden_states(aux[:anchor])
        drafter.write_context_kv(context, torch.arange(anchor), slots, cache)
        step = SequenceStep(4, anchor + 4, [table], causal=False)
        meta = drafter.build_attn_metadata([step], 4, "cpu")
        served = drafter(block, torch.arange(anchor, anchor + 4), meta, cache)
        reference = dflash_dense(
            weights, drafter.config.layer_attention, model.embed_tokens.weight,
            aux[:anchor], block, dims,
        )  # fmt: skip
        torch.testing.assert_close(served, reference, atol=2e-4, rtol=1e-4)
        logits = trainee_block_logits(trainee, tokens, aux, anchor)
        torch.testing.assert_close(model.compute_logits(served[1:]), logits, atol=2e-3, rtol=1e-3)
        # the drafts read the head's bfloat16 screen where it pays
        assert torch.equal(
            drafter.compute_logits(served[1:]), borrowed_head_logits(model, served[1:])
        )


def trainee_block_logits(
    trainee: DFlashTrainee, tokens: torch.Tensor, aux: torch.Tensor, anchor: int
) -> torch.Tensor:
    """The training forward's mask-row logits of one block (its anchors forced to `anchor`)."""
    import specserve.training.dflash as dflash_module

    captured: list[torch.Tensor] = []
    sample_anchors = dflash_module._sample_anchors
    cross_entropy = dflash_module.F.cross_entropy
    try:
        dflash_module._sample_anchors = lambda *a: torch.tensor([anchor])  # type: ignore[assignment]
        dflash_module.F.cross_entropy = lambda x, y, reduction: (  # type: ignore[assignment]
            captured.append(x.detach()) or cross_entropy(x, y, reduction=reduction)
        )
        with torch.no_grad():
            trainee.sequence_loss(tokens, aux, 0, 1, torch.Generator())
    finally:
        dflash_module._sample_anchors = sample_anchors
        dflash_module.F.cross_entropy = cross_entropy
    return captured[0]


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_an_overfit_drafter_is_accepted_through_the_runner(
    method: str, chat_target: Path, prompts_file: Path, tmp_path: Path
) -> None:
    """Trained to memorise the target's answers, the drafter's drafts are accepted by the
    real scheduler, runner and verifier: mean acceptance length above K/2, and the output is
    exactly the target's."""
    args = _args(method, chat_target, prompts_file, tmp_path / "drafter")
    report = train_drafter(args)
    assert report["steps"] == args.steps
    k = args.num_spec_tokens
    samples = read_samples(tmp_path / "drafter" / "data" / "samples.jsonl")
    prompts = [s.prompt for s in samples]
    plain = specserve.LLM(str(chat_target))
    expected = measure(plain, prompts, max_tokens=40, batch=4).outputs
    spec = specserve.LLM(
        str(chat_target),
        spec_method=method,
        drafter=str(tmp_path / "drafter"),
        num_spec_tokens=k,
        spec_policy="fixed",  # acceptance of the drafter, every round verifying all K
    )
    served = measure(spec, prompts, max_tokens=40, batch=4)
    assert served.outputs == expected
    assert served.stats.mean_acceptance_length > k / 2, served.stats
    # --eval-only: served acceptance on held-out prompts beside the drafter's teacher-forced
    # estimate on the very outputs served. They meet only roughly (served rates are per round,
    # the estimate's per position; here both the memorised first 40 tokens and the 88 after),
    # but a drafter that serving ran otherwise than training would fall far from it.
    report = train_drafter(replace(args, eval_only=True, held_out=len(PROMPTS)))
    assert report["prompts"] == len(PROMPTS) and len(report["teacher_forced_accuracy"]) == k
    served_al = report["mean_acceptance_length"]
    estimate = report["teacher_forced_expected_acceptance_length"]
    assert abs(estimate - served_al) < 0.15 * served_al, report


def _assert_same_drafter(a: Path, b: Path) -> dict[str, torch.Tensor]:
    """The drafters saved in `a` and `b` hold the same tensors bit for bit; returns `a`'s."""
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    return first


def test_resume_continues_where_it_stopped(
    chat_target: Path, prompts_file: Path, tmp_path: Path
) -> None:
    work = tmp_path / "data"
    straight = _args("dflash", chat_target, prompts_file, tmp_path / "a", work_dir=work, steps=6)
    train_drafter(replace(straight, checkpoint_every=3))
    stopped = replace(straight, out=tmp_path / "b", steps=3, checkpoint_every=3)
    train_drafter(stopped)
    with pytest.raises(ValueError, match="--resume"):
        train_drafter(replace(stopped, steps=6))
    resumed = train_drafter(replace(stopped, steps=6, resume=True))
    assert resumed["steps"] == 6
    _assert_same_drafter(tmp_path / "a", tmp_path / "b")
    state = torch.load(tmp_path / "b" / STATE_FILE, weights_only=False)
    assert state["step"] == 6


def test_init_starts_from_a_saved_drafter_and_refuses_another_kind(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    data = regenerated / "prompts.jsonl"
    first = _args("eagle3", chat_target, data, tmp_path / "first", work_dir=regenerated, steps=4)
    train_drafter(replace(first, draft_vocab_size=512))
    # A size given explicitly that the saved drafter does not have is refused, not ignored.
    init = replace(first, out=tmp_path / "kept", steps=1, lr=0.0, init=tmp_path / "first")
    with pytest.raises(ValueError, match="the drafter has --draft-vocab-size 512, not 1024"):
        train_drafter(init)
    # At a learning rate of 0 nothing moves, so the run writes back the drafter it started
    # from: its weights, and its draft vocabulary of 512 where this run would count 1,024.
    kept = replace(init, draft_vocab_size=None)
    assert train_drafter(kept)["init"] == str(tmp_path / "first")
    started = _assert_same_drafter(tmp_path / "first", tmp_path / "kept")
    assert started["d2t"].numel() == 512
    train_drafter(replace(kept, out=tmp_path / "moved", lr=3e-3))  # trained on from there
    moved = load_file(tmp_path / "moved" / "model.safetensors")
    assert torch.equal(moved["d2t"], started["d2t"])
    assert not torch.equal(moved["fc.weight"], started["fc.weight"])

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(ValueError, match="is DFlashDraftModel, not LlamaForCausalLMEagle3"):
        train_drafter(replace(kept, init=other))
    config = json.loads((tmp_path / "first" / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 1, 2\], the data records"):
        train_drafter(replace(kept, init=other))


def test_init_refuses_a_dflash_drafter_of_other_sizes_than_asked(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    data = regenerated / "prompts.jsonl"
    saved = _args("dflash", chat_target, data, tmp_path / "saved", work_dir=regenerated, steps=1)
    train_drafter(replace(saved, num_layers=1))
    init = replace(saved, out=tmp_path / "next", init=tmp_path / "saved")
    with pytest.raises(ValueError, match="the drafter has --num-layers 1, not 2"):
        train_drafter(init)
    with pytest.raises(ValueError, match="the drafter has --num-spec-tokens 3, not 7"):
        train_drafter(replace(init, num_layers=None, num_spec_tokens=7))
    report = train_drafter(replace(init, num_layers=None, num_spec_tokens=None))
    assert report["steps"] == 1
    config = json.loads((tmp_path / "next" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["block_size"]) == (1, 4)


def test_skip_chats_passes_over_leading_training_chats(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    data = regenerated / "prompts.jsonl"
    args = _args("eagle3", chat_target, data, tmp_path / "out", work_dir=regenerated, steps=1)
    whole = train_drafter(args)
    skipped = train_drafter(replace(args, out=tmp_path / "skipped", skip_chats=2))
    assert whole["train_samples"] == len(PROMPTS)  # one answered turn a prompt
    assert skipped["train_samples"] == len(PROMPTS) - 2
    assert skipped["skip_chats"] == 2
    with pytest.raises(
        ValueError, match=f"{len(PROMPTS)} chats, .* and the {len(PROMPTS)} skipped"
    ):
        train_drafter(replace(args, out=tmp_path / "none", skip_chats=len(PROMPTS)))


def test_bad_input_is_refused_with_a_message_naming_it(
    chat_target: Path, prompts_file: Path, regenerated: Path, tmp_path: Path
) -> None:
    args = _args("eagle3", chat_target, prompts_file, tmp_path / "out", steps=1)
    with pytest.raises(CorpusError, match=r"cannot read data file .*missing.jsonl"):
        train_drafter(replace(args, data=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: not JSON"):
        train_drafter(replace(args, data=str(bad), work_dir=tmp_path / "w1"))
    with pytest.raises(ValueError, match=r"--max-len 4096 exceeds .* maximum length 512"):
        train_drafter(replace(args, max_len=4096))
    # Data regenerated by another target (another vocabulary) is not mixed in.
    manifest = json.loads((regenerated / "manifest.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(
        json.dumps({**manifest, "model": "smollm2-135m", "vocab_size": 32000})
    )
    with pytest.raises(ValueError, match="regenerated by 'smollm2-135m' \\(vocabulary 32000\\)"):
        train_drafter(replace(args, work_dir=other))
    # A drafter trained for another target is not evaluated (nor resumed) against this one.
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text(
        json.dumps({"specserve_training": {"target": "smollm2-135m"}})
    )
    with pytest.raises(ValueError, match="trained for 'smollm2-135m'"):
        train_drafter(replace(args, out=tmp_path / "foreign", eval_only=True))


def test_the_command_trains_and_refuses_bad_input_with_a_message(
    chat_target: Path, prompts_file: Path, tmp_path: Path
) -> None:
    """`specserve train-drafter` as a user runs it: a progress bar, the drafter and a report;
    an unreadable data file is an error naming it (exit status 2, no traceback)."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "specserve.cli", "train-drafter", "--method", "dflash",
            "--model", str(chat_target), "--max-len", "96", "--max-new-tokens", "16",
            "--max-turns", "1", "--held-out", "0", "--steps", "2", "--num-spec-tokens", "3",
            "--threads", "1"]  # fmt: skip
    out = tmp_path / "drafter"
    done = subprocess.run(
        [*base, "--data", str(prompts_file), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "training dflash" in done.stderr and "2/2" in done.stderr  # the progress bar
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 2 and report["command"].startswith("specserve train-drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    missing = subprocess.run(
        [*base, "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "error: cannot read data file" in missing.stderr and "nope.jsonl" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_time_limit_cuts_the_steps_once_their_pace_is_measured(
    chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    """`--time-limit`: the first step warms up, the next TIME_PROBE_STEPS are timed, and the
    run is cut to what fits (here nothing more: the limit is already spent)."""
    from specserve.training.trainer import TIME_PROBE_STEPS

    data = regenerated / "prompts.jsonl"
    args = _args("eagle3", chat_target, data, tmp_path / "drafter", work_dir=regenerated)
    report = train_drafter(replace(args, steps=50, time_limit=0.001))
    assert report["steps"] == 1 + TIME_PROBE_STEPS
    state = torch.load(tmp_path / "drafter" / STATE_FILE, weights_only=False)
    assert state["step"] == 1 + TIME_PROBE_STEPS  # saved at the new end
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["specserve_training"]["steps"] == 1 + TIME_PROBE_STEPS


def test_a_cuda_device_without_a_gpu_is_refused(chat_target: Path, prompts_file: Path) -> None:
    from specserve.training.pipeline import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert resolve_device("auto") == "cpu"
    args = _args("eagle3", chat_target, prompts_file, Path("unused"), device="cuda")
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA GPU"):
        train_drafter(args)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_drafters_loss_on_a_gpu_is_the_hosts(
    method: str, chat_target: Path, regenerated: Path, tmp_path: Path
) -> None:
    """The same drafter, sample and anchors on CUDA and on the CPU: the same loss and rows, and
    the same hits up to a near tie (float32), so nothing in the loss is left on the wrong device
    or indexed off it."""
    import copy

    from specserve.training.trainer import Metrics

    on_cpu = _trainer(method, chat_target, regenerated, tmp_path / "cpu")
    on_gpu = copy.copy(on_cpu)
    on_gpu.trainee = copy.deepcopy(on_cpu.trainee).to("cuda")
    on_gpu.device = torch.device("cuda")
    on_gpu.generator = torch.Generator().manual_seed(0)
    on_cpu.generator.manual_seed(0)
    for sample in on_cpu.train[:4]:
        host, device = Metrics(), Metrics()
        a = on_cpu.sample_loss(sample, host)
        b = on_gpu.sample_loss(sample, device)
        assert b is not None and a is not None and b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
        assert device.rows == host.rows
        # hits are argmax matches: a near tie may round the other way on the other device
        assert all(abs(a - b) <= 1 for a, b in zip(device.correct, host.correct, strict=True))


def test_regeneration_stops_between_waves_at_its_time_limit_and_goes_on_later(
    chat_target: Path, tmp_path: Path
) -> None:
    """A time limit already spent: the first wave runs (one always does), the next does not; a
    later call answers the rest and keeps the first wave's samples as they were."""
    from specserve.training.corpus import read_chats
    from specserve.training.regenerate import RegenerateOptions, regenerate

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    chats = list(read_chats(str(data)))
    llm = specserve.LLM(str(chat_target), max_num_seqs=4, enable_prefix_caching=False)
    options = RegenerateOptions(96, 8, 1, 4, wave=4, time_limit=0.0)
    first = regenerate(llm, chats, set(), tmp_path / "work", LAYERS, options)
    assert sorted(s.chat for s in first) == sorted(c.id for c in chats[:4])
    rest = regenerate(
        llm, chats, set(), tmp_path / "work", LAYERS, replace(options, time_limit=None)
    )
    assert sorted(s.chat for s in rest) == sorted(c.id for c in chats)
    assert [s for s in rest if s.chat in {c.id for c in chats[:4]}] == first


def test_no_regenerate_takes_the_samples_there_and_answers_nothing(
    chat_target: Path, prompts_file: Path, tmp_path: Path
) -> None:
    """`--no-regenerate`: the samples already recorded, the work directory only read (so runs
    with other settings can train from it side by side); none there is an error naming it."""
    from specserve.training.corpus import read_chats
    from specserve.training.regenerate import RegenerateOptions, regenerate

    chats = list(read_chats(str(prompts_file)))
    llm = specserve.LLM(str(chat_target), max_num_seqs=4, enable_prefix_caching=False)
    options = RegenerateOptions(96, 8, 1, 4, wave=4, time_limit=0.0)
    first = regenerate(llm, chats, set(), tmp_path / "work", LAYERS, options)  # one wave of 4
    index = tmp_path / "work" / "samples.jsonl"
    written = index.stat().st_mtime_ns
    kept = replace(options, time_limit=None, answer_new=False)
    assert regenerate(llm, chats, set(), tmp_path / "work", LAYERS, kept) == first
    assert index.stat().st_mtime_ns == written and len(first) == 4
    args = _args("eagle3", chat_target, prompts_file, tmp_path / "out", steps=1)
    with pytest.raises(ValueError, match=r"--no-regenerate: .*empty holds no training samples"):
        train_drafter(replace(args, no_regenerate=True, work_dir=tmp_path / "empty"))


def test_dataset_answers_are_trained_on_with_the_targets_rows_and_held_out_chats_regenerated(
    chat_target: Path, tmp_path: Path
) -> None:
    """`--answers dataset`: a training sample is the data's own answer (its tokens and EOS, cut
    to the room left), a later turn's history holds the data's earlier answer, and every row
    is the target's hidden state there (one prefill); held-out chats are answered by the
    target as without the flag."""
    from specserve.shared.tokenizer import load_tokenizer

    def chat(i: int) -> dict:
        return {"id": f"c{i}", "messages": [
            {"role": "user", "content": PROMPTS[i]},
            {"role": "assistant", "content": f"Answer number {i}: " + "word " * (4 * i)},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "Then it ends."},
        ]}  # fmt: skip

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(6)))
    work = tmp_path / "work"
    args = _args("eagle3", chat_target, data, tmp_path / "drafter", work_dir=work, steps=1)
    args = replace(args, answers="dataset", held_out=2, eval_samples=2, max_samples=4,
                   max_turns=2, max_new_tokens=24)  # fmt: skip
    report = train_drafter(args)
    assert report["answers"] == "dataset"
    samples = read_samples(work / "samples.jsonl")
    tokenizer = load_tokenizer(str(chat_target))
    eos = tokenizer.eos_token_ids[0]
    train = [s for s in samples if not s.held_out]
    assert sorted((s.chat, s.turn) for s in train) == [(f"c{i}", t) for i in range(2, 6)
                                                       for t in (0, 1)]  # fmt: skip
    for sample in train:
        record = chat(int(sample.chat[1:]))["messages"]
        answer = record[2 * sample.turn + 1]["content"]
        full = [*tokenizer.encode(answer, add_special_tokens=False), eos]
        assert sample.response == full[:24]
        assert sample.finish == ("stop" if len(full) <= 24 else "length")
        history = tokenizer.apply_chat_template(record[: 2 * sample.turn + 1],
                                                add_generation_prompt=True)  # fmt: skip
        assert sample.prompt == tokenizer.encode(history, add_special_tokens=False)
    assert any(s.finish == "length" for s in train) and any(s.finish == "stop" for s in train)
    model = load_model(chat_target)
    reader = ShardReader(work / "shards")
    _assert_rows_are_the_targets(model, reader, train[:3])
    held = [s for s in samples if s.held_out]
    assert sorted(s.chat for s in held if s.turn == 0) == ["c0", "c1"]
    llm = specserve.LLM(str(chat_target))
    first_turns = [s for s in held if s.turn == 0]
    outputs = llm.generate([s.prompt for s in first_turns],
                           specserve.SamplingParams(max_tokens=24, temperature=0.0))  # fmt: skip
    assert [s.response for s in first_turns] == [list(o.token_ids) for o in outputs]
    assert all(s.by_data for s in train) and not any(s.by_data for s in held)
    # EAGLE-3's draft vocabulary counts what the target would say at the data's answers (its
    # argmax from the recorded rows), not the answers' own tokens.
    head = model.embed_tokens.weight  # tied in this target
    counts = torch.zeros(head.shape[0], dtype=torch.int64)
    for sample in train:
        _, _, final = reader.rows(sample.rows, sample.num_tokens)
        said = (final[len(sample.prompt) - 1 : sample.num_tokens - 1] @ head.T).argmax(-1)
        counts += torch.bincount(said, minlength=head.shape[0])
    wanted = sorted(sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))[:1024])
    d2t = load_file(str(tmp_path / "drafter" / "model.safetensors"))["d2t"]
    assert (d2t + torch.arange(d2t.numel())).tolist() == wanted
    answered = {t for s in train for t in s.response}
    assert not answered <= set(wanted)  # the answers' own tokens would have been chosen
    # The work directory now holds the data's answers: regenerated data is not mixed in.
    with pytest.raises(ValueError, match=r"answers='dataset' \(now 'target'\)"):
        train_drafter(replace(args, answers="target"))


def test_dataset_answers_need_a_data_file_with_answers(
    chat_target: Path, prompts_file: Path, tmp_path: Path
) -> None:
    args = _args("eagle3", chat_target, prompts_file, tmp_path / "out", answers="dataset")
    with pytest.raises(ValueError, match=r"--answers dataset: .*prompts.jsonl holds no assistant"):
        train_drafter(args)


def test_samples_whose_shard_is_gone_get_their_rows_again_by_a_prefill(
    chat_target: Path, tmp_path: Path
) -> None:
    """Token ids carried without their rows (a shard deleted): the next call rebuilds the rows
    of exactly those samples from the tokens they hold (not by answering again: one response
    here is not what the target would say), into a new shard that takes no name in use."""
    import msgspec

    from specserve.training.corpus import read_chats
    from specserve.training.regenerate import RegenerateOptions, regenerate

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:6]))
    chats = list(read_chats(str(data)))
    work = tmp_path / "work"
    llm = specserve.LLM(str(chat_target), max_num_seqs=4, enable_prefix_caching=False)
    options = RegenerateOptions(96, 8, 1, 4, wave=3)
    first = regenerate(llm, chats, set(), work, LAYERS, options)
    assert sorted({s.shard for s in first}) == ["wave-00000.safetensors", "wave-00001.safetensors"]
    carried = [s for s in first if s.shard == "wave-00000.safetensors"]
    odd = msgspec.structs.replace(carried[0], response=[7, 8, 9, 10])  # not the target's answer
    lines = [msgspec.json.encode(odd if s is carried[0] else s) for s in first]
    (work / "samples.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (work / "shards" / "wave-00000.safetensors").unlink()
    again = regenerate(llm, chats, set(), work, LAYERS, options)
    by_chat = {s.chat: s for s in again}
    assert len(again) == len(first)
    for sample in first:
        now = by_chat[sample.chat]
        want = odd if sample.chat == odd.chat else sample
        assert (now.prompt, now.response) == (want.prompt, want.response)
        if sample.shard == "wave-00001.safetensors":
            assert (now.shard, now.row) == (sample.shard, sample.row)  # kept as it was
        else:
            assert now.shard == "wave-00002.safetensors"
    _assert_rows_are_the_targets(
        load_model(chat_target), ShardReader(work / "shards"), [by_chat[s.chat] for s in carried]
    )
    assert read_samples(work / "samples.jsonl") == again
