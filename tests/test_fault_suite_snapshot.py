"""``scripts/fault_suite.py`` ships a snapshot of the app (pyproject + packages): Flower must be able to build it
into a FAB.  Flower 1.39 refuses a ``fab-exclude`` pattern that matches nothing, and the snapshot holds none of
the paths the repository's ``fab-exclude`` names, so the snapshot drops that key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from scripts.fault_suite import ROOT, snapshot_app

FLWR = Path(sys.executable).parent / "flwr"


def test_repository_excludes_paths_from_its_fab():
    with (ROOT / "pyproject.toml").open("rb") as f:
        assert tomllib.load(f)["tool"]["flwr"]["app"].get("fab-exclude")  # what the snapshot must cope with


def test_snapshot_builds_a_fab(tmp_path):
    app, digest = snapshot_app(tmp_path / "app")
    with (app / "pyproject.toml").open("rb") as f:
        cfg = tomllib.load(f)
    assert "fab-exclude" not in cfg["tool"]["flwr"]["app"]
    with (ROOT / "pyproject.toml").open("rb") as f:
        assert cfg["tool"]["flwr"]["app"]["config"] == tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    res = subprocess.run([str(FLWR), "build", "--app", str(app)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(tmp_path.glob("*.fab")), res.stdout
    assert snapshot_app(tmp_path / "again")[1] == digest  # the same tree, the same digest
