"""docs/service.md's "Input limits" table names every `--max-...` flag with the default that
`ServiceLimits` (and so the command line) really has."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from specserve.control.limits import ServiceLimits

DOC = Path(__file__).resolve().parents[2] / "docs" / "service.md"


def test_input_limits_table_matches_service_limits() -> None:
    text = DOC.read_text()
    section = text.split("## Input limits\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `--([a-z-]+)` \| (\d+)", section, re.MULTILINE))
    expected = {f.name.replace("_", "-"): str(f.default) for f in dataclasses.fields(ServiceLimits)}
    assert rows == expected
