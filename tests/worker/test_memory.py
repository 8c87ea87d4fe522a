"""KV cache sizing from the memory left after the weights (`--kv-cache-memory-fraction`), and
the allocator keeping freed blocks for reuse."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.llm import LLM
from specserve.shared.config import AttentionType
from specserve.worker import memory
from specserve.worker.kv_cache import PagedKVCache, bytes_per_block
from specserve.worker.model_config import KVLayerGroup


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


# A fresh process per run: malloc's settings are process-wide. glibc's own account
# (mallinfo2): bytes in blocks mapped on their own, and bytes of the heap, while a prompt
# chunk's 20 MB buffer is alive and after it is freed.
_MALLOC_PROBE = """
import ctypes, sys, torch
from specserve.worker.memory import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
mapped = libc.mallinfo2().hblkhd
x = torch.empty(20 << 20, dtype=torch.uint8)
x.fill_(1)
mapped_alive = libc.mallinfo2().hblkhd - mapped
del x
print(applied, mapped_alive >> 20, libc.mallinfo2().arena >> 20)
"""


def _malloc_probe(mode: str) -> tuple[str, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    done = subprocess.run(
        [sys.executable, "-c", _MALLOC_PROBE, mode], env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    applied, mapped_mb, heap_mb = done.stdout.splitlines()[-1].split()
    return applied, int(mapped_mb), int(heap_mb)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_large_freed_blocks_stay_in_the_heap_for_reuse():
    """By default glibc maps a 20 MB block on its own and unmaps it when freed (the next one is
    faulted in and zeroed again); kept, it comes from the heap, which keeps it when freed."""
    assert _malloc_probe("default")[1] >= 20
    applied, mapped_mb, heap_mb = _malloc_probe("keep")
    assert applied == "True"
    assert mapped_mb == 0
    assert heap_mb >= 20


@pytest.mark.parametrize(
    "env",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
    ],
)
def test_a_users_own_malloc_settings_are_left_alone(env):
    assert memory.keep_freed_memory(env) is False


def _group(*layer_ids: int) -> KVLayerGroup:
    return KVLayerGroup(AttentionType.FULL, None, layer_ids)


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def _huge_pages_on_request() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_kv_cache_is_zeros_in_memory_advised_for_huge_pages(dtype):
    """Each layer's cache is zeros of its shape in a mapping of its own that the kernel may back
    with 2 MiB pages; the mapping lives as long as the tensor."""
    cache = PagedKVCache([_group(0, 1)], 256, 16, 3, 64, dtype, "cpu")
    layer = cache.layer(1)
    assert layer.shape == (256, 2, 16, 3, 64) and layer.dtype == dtype
    assert layer.is_contiguous() and not layer.any()
    assert cache.layer(0).data_ptr() != layer.data_ptr()
    gc.collect()
    layer[255, 1, 15] = 2.0  # the last element is ours to write
    assert layer.float().sum().item() == 2.0 * 3 * 64
    if sys.platform == "linux" and _huge_pages_on_request():
        mapping = _mapping_of(layer.data_ptr())
        assert "hg" in mapping["VmFlags"].split()
        assert mapping["THPeligible"] == "1"


def test_a_gpu_kv_cache_is_not_placed_by_the_cpu_path(monkeypatch):
    """Only CPU caches take the mapping path: a device cache is `torch.zeros` on the device."""
    calls = []
    monkeypatch.setattr("specserve.worker.kv_cache.zeros_in_huge_pages", lambda *a: calls.append(a))
    cache = PagedKVCache([_group(0)], 4, 16, 3, 64, torch.float32, "meta")
    assert cache.layer(0).device.type == "meta" and calls == []
