"""client/fab_cache.py: a forked ClientApp installs a FAB through Flower once per node, not once per message.

Real FABs built by ``flwr build`` from a two-file app, installed into a temporary ``FLWR_HOME`` by Flower's own
``install_from_fab``; the cache in front of it is checked for what it skips and, above all, what it must not.
"""

from __future__ import annotations

import importlib
import io
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import click
import pytest
from flwr.cli.install import install_from_fab
from flwr.supercore.utils import get_flwr_home

from client import fab_cache

FLWR = Path(sys.executable).parent / "flwr"
PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tiny"
version = "{version}"
dependencies = []

[tool.flwr.app]
publisher = "pgvitest"

[tool.flwr.app.components]
serverapp = "tiny.app:server"
clientapp = "tiny.app:client"

[tool.flwr.app.config]
x = 1
"""


def _build_fab(where: Path, version: str, body: str = "client = server = None\n",
               extra: dict[str, str] | None = None) -> bytes:
    app = where / f"tiny-{version.replace('.', '-')}"  # Flower: letters, digits, hyphens
    (app / "tiny").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT.format(version=version))
    (app / "tiny" / "__init__.py").write_text("")
    (app / "tiny" / "app.py").write_text(body)
    for name, text in (extra or {}).items():
        (app / "tiny" / name).write_text(text)
    res = subprocess.run([str(FLWR), "build", "--app", str(app)], cwd=where, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (fab,) = where.glob(f"pgvitest.tiny.{version.replace('.', '-')}.*.fab")
    return fab.read_bytes()


@pytest.fixture(scope="module")
def fabs(tmp_path_factory) -> dict[str, bytes]:
    where = tmp_path_factory.mktemp("fabs")
    return {"a": _build_fab(where, "1.0.0"), "b": _build_fab(where, "1.0.1", "client = server = 1\n")}


class Counting:
    """Flower's ``install_from_fab``, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fab_file, install_dir=None, skip_prompt=False):
        self.calls += 1
        return install_from_fab(fab_file, install_dir=install_dir, skip_prompt=skip_prompt)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    return tmp_path / "flwr-home"


def test_second_install_of_the_same_bytes_skips_flowers_extraction(fabs, home):
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    first = cached(fabs["a"], skip_prompt=True)
    assert flower.calls == 1 and first.is_dir() and first.parent == home / "apps"
    assert (first / "tiny" / "app.py").read_text() == "client = server = None\n"
    again = [cached(fabs["a"], skip_prompt=True) for _ in range(3)]
    assert flower.calls == 1 and again == [first] * 3
    assert install_from_fab(fabs["a"], skip_prompt=True) == first  # the directory Flower itself returns


def test_other_bytes_go_through_flower(fabs, home):
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    a, b = cached(fabs["a"], skip_prompt=True), cached(fabs["b"], skip_prompt=True)
    assert flower.calls == 2 and a != b and (b / "tiny" / "app.py").read_text() == "client = server = 1\n"
    assert cached(fabs["b"], skip_prompt=True) == b and flower.calls == 2
    assert sorted(p.name for p in (home / fab_cache.MARKER_DIR / "unknown").iterdir()) == sorted(
        __import__("hashlib").sha256(f).hexdigest() for f in fabs.values())


def test_a_removed_install_is_installed_again(fabs, home):
    import shutil

    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    path = cached(fabs["a"], skip_prompt=True)
    shutil.rmtree(path)
    assert cached(fabs["a"], skip_prompt=True) == path and flower.calls == 2 and path.is_dir()


def test_a_tampered_fab_is_refused_by_flower_and_never_marked(fabs, home):
    """Same length, one file changed inside: the bytes' digest differs from the installed FAB's, so Flower's
    manifest check runs, and refuses it; no marker is written for it, however often it is sent."""
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    cached(fabs["a"], skip_prompt=True)
    src = zipfile.ZipFile(io.BytesIO(fabs["a"]))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            out.writestr(info, data.replace(b"None", b"Nope") if info.filename.endswith("app.py") else data)
    bad = buf.getvalue()
    for _ in range(2):
        with pytest.raises(click.ClickException, match="hashes couldn't be verified"):
            cached(bad, skip_prompt=True)
    assert flower.calls == 3
    assert len(list((home / fab_cache.MARKER_DIR / "unknown").iterdir())) == 1


def test_a_marker_that_does_not_name_these_bytes_install_falls_back_to_flower(fabs, home, tmp_path):
    """Empty (as after a power loss before the rename), not text, a missing or relative directory, another FAB's
    directory, a directory outside FLWR_HOME/apps, one without the app: Flower installs, the marker is rewritten."""
    import hashlib

    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    path_b = cached(fabs["b"], skip_prompt=True)
    path_a = cached(fabs["a"], skip_prompt=True)
    marker = home / fab_cache.MARKER_DIR / "unknown" / hashlib.sha256(fabs["a"]).hexdigest()
    assert marker.read_text() == str(path_a) and flower.calls == 2
    outside = tmp_path / "apps" / path_a.name  # the right name under another FLWR_HOME
    (outside / "tiny").mkdir(parents=True)
    (outside / "pyproject.toml").write_text("")
    for bad in ("", "\xff\xfe", str(home / "no-such-dir"), "apps/x", str(path_b), str(outside), str(home / "apps")):
        marker.write_bytes(bad.encode("latin-1"))
        calls = flower.calls
        assert cached(fabs["a"], skip_prompt=True) == path_a
        assert flower.calls == calls + 1, bad
        assert cached(fabs["a"], skip_prompt=True) == path_a != path_b and marker.read_text() == str(path_a)
        assert flower.calls == calls + 1  # the rewritten marker serves the next message
    (path_a / "pyproject.toml").unlink()  # an install without its app: Flower's (which finds it "installed")
    calls = flower.calls
    cached(fabs["a"], skip_prompt=True)
    assert flower.calls == calls + 1
    assert not [p.name for p in marker.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary files left


def test_paths_and_other_install_dirs_are_flowers(fabs, home, tmp_path):
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    elsewhere = tmp_path / "elsewhere"
    for _ in range(2):
        assert cached(fabs["a"], install_dir=elsewhere, skip_prompt=True).parent == elsewhere / "apps"
    digest = __import__("hashlib").sha256(fabs["a"]).hexdigest()
    fab_path = tmp_path / f"pgvitest.tiny.1-0-0.{digest[:8]}.fab"  # the name Flower checks against the content
    fab_path.write_bytes(fabs["a"])
    for _ in range(2):
        assert cached(fab_path, skip_prompt=True).parent == home / "apps"
    assert flower.calls == 4 and not (home / fab_cache.MARKER_DIR).exists()


def test_install_replaces_flowers_name_once(monkeypatch, fabs, home):
    module = importlib.import_module(fab_cache.MODULE)
    monkeypatch.setattr(module, fab_cache.NAME, install_from_fab)
    assert fab_cache.install() is True
    patched = getattr(module, fab_cache.NAME)
    assert patched is not install_from_fab and patched.pgvi_fab_cache
    assert fab_cache.install() is True and getattr(module, fab_cache.NAME) is patched  # not wrapped twice
    import contextlib
    import hashlib
    from importlib.metadata import version as installed_version

    with contextlib.redirect_stdout(io.StringIO()):
        path = patched(fabs["a"], skip_prompt=True)
    version = installed_version("flwr")  # markers are kept per Flower version
    assert (home / fab_cache.MARKER_DIR / version / hashlib.sha256(fabs["a"]).hexdigest()).read_text() == str(path)


def test_install_refuses_another_flower_version(monkeypatch, caplog):
    module = importlib.import_module(fab_cache.MODULE)
    monkeypatch.setattr(module, fab_cache.NAME, install_from_fab)
    monkeypatch.setattr(fab_cache, "version_problem", lambda: "flwr 1.40.0 is not 1.39.x")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert fab_cache.install() is False
    assert getattr(module, fab_cache.NAME) is install_from_fab
    assert "FABs are installed by Flower for every message" in caplog.text


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("", True), ("1", True), (" on ", True),
                                               ("0", False), ("false", False), ("OFF", False)])
def test_enabled_from_env(raw, expected):
    env = {} if raw is None else {fab_cache.ENV_FAB_CACHE: raw}
    assert fab_cache.enabled_from_env(env) is expected


def test_module_refuses_a_bad_fab_cache_value():
    import os

    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "client.preforked_superexec", "--help"], cwd=repo,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PGVI_FAB_CACHE": "maybe"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["pgvi-superexec: PGVI_FAB_CACHE='maybe' must be 0 or 1 (or false/true, no/yes, off/on)"]


def test_a_relative_flwr_home_hits_the_cache(fabs, tmp_path, monkeypatch):
    """FLWR_HOME=rel-home: Flower installs under <cwd>/rel-home and returns a relative path; the marker used to be
    refused as relative, so every message ran Flower's install (review of the client plumbing, finding 4)."""
    import hashlib

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLWR_HOME", "rel-home")
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    paths = [cached(fabs["a"], skip_prompt=True) for _ in range(3)]
    assert flower.calls == 1
    assert paths[0].is_absolute() and paths == [tmp_path / "rel-home" / "apps" / paths[0].name] * 3
    assert (paths[0] / "tiny" / "app.py").is_file()
    marker = tmp_path / "rel-home" / fab_cache.MARKER_DIR / "unknown" / hashlib.sha256(fabs["a"]).hexdigest()
    assert marker.read_text() == str(paths[0])
    elsewhere = tmp_path / "elsewhere"  # the same relative FLWR_HOME from another directory is another FLWR_HOME
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cached(fabs["a"], skip_prompt=True) == elsewhere / "rel-home" / "apps" / paths[0].name
    assert flower.calls == 2


def test_an_incomplete_install_is_never_marked(fabs, home, caplog):
    """Flower returns an existing install directory as it is: one another ClientApp is still copying into, or one
    an install cut short (a full disk) left.  The cache marks it only once it holds every file of the FAB at its
    size, and says what it lacks until then."""
    import hashlib

    path = install_from_fab(fabs["a"], skip_prompt=True)  # Flower alone
    app = path / "tiny" / "app.py"
    app.unlink()
    marker = home / fab_cache.MARKER_DIR / "unknown" / hashlib.sha256(fabs["a"]).hexdigest()
    flower = Counting()
    cached = fab_cache.make_cached_install(flower, get_flwr_home)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert [cached(fabs["a"], skip_prompt=True) for _ in range(2)] == [path, path]
    assert flower.calls == 2 and not marker.exists()
    assert f"{path} lacks 1 of the FAB's files (e.g. tiny/app.py)" in caplog.text
    app.write_text("client = ")  # a truncated copy
    cached(fabs["a"], skip_prompt=True)
    assert flower.calls == 3 and not marker.exists()
    app.write_text("client = server = None\n")  # complete: marked by the next message, a hit after that
    assert cached(fabs["a"], skip_prompt=True) == path and marker.read_text() == str(path)
    assert cached(fabs["a"], skip_prompt=True) == path and flower.calls == 4


def test_the_installed_modules_are_compiled_once_so_clientapps_import_them_without_compiling(fabs, home, monkeypatch):
    """With ``PYTHONDONTWRITEBYTECODE`` set (this sandbox, many container images) Python never caches bytecode: every
    ClientApp compiled the FAB's modules from source.  The install now writes it; a fresh interpreter with the variable
    set loads the module from that bytecode (``-v`` says which file it used)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    cached = fab_cache.make_cached_install(Counting(), get_flwr_home)
    path = cached(fabs["a"], skip_prompt=True)
    pyc = sorted(p.name for p in (path / "tiny" / "__pycache__").iterdir())
    assert pyc == [f"__init__.{sys.implementation.cache_tag}.pyc", f"app.{sys.implementation.cache_tag}.pyc"]
    res = subprocess.run([sys.executable, "-v", "-c", "import tiny.app"], cwd=path, capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert res.returncode == 0, res.stderr
    source = str(path / "tiny" / "app.py")
    used = [line for line in res.stderr.splitlines() if line.endswith(source)]
    assert used == [f"# {path / 'tiny' / '__pycache__' / pyc[1]} matches {source}"], res.stderr[-2000:]
    # a source changed after the install is still compiled afresh at import (the bytecode is checked against the
    # source's timestamp and size)
    (path / "tiny" / "app.py").write_text("client = server = 'changed'\n")
    res = subprocess.run([sys.executable, "-c", "import tiny.app; print(tiny.app.client)"], cwd=path,
                         capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "changed", res.stderr


def test_a_module_that_does_not_compile_leaves_the_install_usable_and_marked(fabs, home, tmp_path, caplog):
    where = tmp_path / "bad"
    where.mkdir()
    bad = _build_fab(where, "1.0.2", extra={"broken.py": "x = (\n"})  # a syntax error: Flower installs it all the same
    cached = fab_cache.make_cached_install(Counting(), get_flwr_home)
    with caplog.at_level(logging.DEBUG, logger="flwr"):
        path = cached(bad, skip_prompt=True)
    assert (path / "tiny" / "broken.py").is_file()
    assert "were not compiled" in caplog.text
    assert (path / "tiny" / "__pycache__" / f"app.{sys.implementation.cache_tag}.pyc").is_file()  # the others are
    assert cached(bad, skip_prompt=True) == path  # marked: the next message skips Flower's install
