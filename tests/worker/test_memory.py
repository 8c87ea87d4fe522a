"""KV cache sizing from the memory left after the weights (`--kv-cache-memory-fraction`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.llm import LLM
from specserve.worker import memory
from specserve.worker.kv_cache import bytes_per_block


def fake_root(tmp_path: Path, available_kb: int, cgroup: tuple[str, str] | None) -> Path:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal: 32000000 kB\nMemFree: 1000 kB\nMemAvailable: {available_kb} kB\n"
    )
    fs = tmp_path / "sys" / "fs" / "cgroup"
    fs.mkdir(parents=True)
    if cgroup is not None:
        (fs / "memory.max").write_text(cgroup[0] + "\n")
        (fs / "memory.current").write_text(cgroup[1] + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (None, 8_000_000 * 1024),  # no cgroup files: MemAvailable
        (("max", "123"), 8_000_000 * 1024),  # no limit
        ((str(6 << 30), str(2 << 30)), 4 << 30),  # the pod's limit less what it uses
        ((str(64 << 30), str(1 << 30)), 8_000_000 * 1024),  # the machine is the tighter bound
        ((str(1 << 30), str(2 << 30)), 0),  # over its limit already
    ],
)
def test_free_cpu_memory_is_meminfo_within_the_cgroup(tmp_path, cgroup, expected):
    root = fake_root(tmp_path, 8_000_000, cgroup)
    assert memory.free_memory_bytes("cpu", root) == expected


def test_the_fraction_is_checked():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
            memory.kv_budget_bytes("cpu", bad)


def test_an_engine_sizes_its_cache_from_the_fraction(llama_ckpt, monkeypatch):
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 10 << 20)
    llm = LLM(str(llama_ckpt.path), block_size=4, kv_cache_memory_fraction=0.5)
    config = llm.engine.loaded.model.config
    per_block = bytes_per_block(
        config.num_layers, 4, config.num_kv_heads, config.head_dim, llm.engine.loaded.model.dtype
    )
    assert llm.engine.worker.num_blocks == (5 << 20) // per_block
