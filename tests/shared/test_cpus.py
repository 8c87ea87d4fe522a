"""Cores, quotas and thread waiting for workers (`shared/cpus.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specserve.shared.cpus import (
    SPIN_COUNT,
    cgroup_cpu_limit,
    divide_cpus,
    parse_cpus,
    set_spin_default,
    usable_cpus,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,6, 4", [0, 1, 4, 6]), ("2,2-3", [2, 3])],
)
def test_cpu_lists_parse(text: str, cpus: list[int]):
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2"])
def test_bad_cpu_lists_are_refused(text: str):
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_cores_divide_into_contiguous_shares():
    assert divide_cpus([0, 1], 2) == [[0], [1]]
    assert divide_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert divide_cpus([4, 5, 6, 7], 1) == [[4, 5, 6, 7]]
    assert divide_cpus([0, 1], 3) == [[0], [1], [0]]  # fewer cores than workers: shared


def test_cgroup_quotas_are_read_in_both_versions(tmp_path: Path):
    assert cgroup_cpu_limit(tmp_path) is None  # no files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0


def test_usable_cpus_are_the_affinity_mask_within_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {3, 1, 2, 0})
    monkeypatch.setattr("specserve.shared.cpus.cgroup_cpu_limit", lambda: None)
    assert usable_cpus() == [0, 1, 2, 3]
    monkeypatch.setattr("specserve.shared.cpus.cgroup_cpu_limit", lambda: 2.5)
    assert usable_cpus() == [0, 1]
    monkeypatch.setattr("specserve.shared.cpus.cgroup_cpu_limit", lambda: 0.2)
    assert usable_cpus() == [0]


def test_the_spin_default_never_overrides_the_user():
    env: dict[str, str] = {}
    set_spin_default(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        set_spin_default(env)
        assert env == chosen
