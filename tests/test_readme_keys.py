"""The README's run-config table names every key of pyproject.toml's [tool.flwr.app.config] (and no other)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_config_keys() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def _readme_table_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    # the first column of each row of the run-config table: the backticked key names
    return {k for row in rows for k in re.findall(r"`([a-z0-9-]+)`", row.split(" | ")[0])}


def test_every_run_config_key_is_in_the_readme_table():
    missing = _run_config_keys() - _readme_table_keys()
    assert not missing, f"run-config keys missing from README.md's table: {sorted(missing)}"


def test_the_readme_table_names_no_unknown_key():
    unknown = _readme_table_keys() - _run_config_keys()
    assert not unknown, f"README.md's table names keys pyproject.toml does not have: {sorted(unknown)}"
