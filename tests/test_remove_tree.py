"""scripts/remove_tree.py: removing a directory that another process may still be writing into."""

from __future__ import annotations

import errno
import shutil
import time

import pytest

from scripts import remove_tree as rt


def _tree(root):
    (root / "a" / "logs").mkdir(parents=True)
    (root / "a" / "logs" / "driver.log").write_text("x")
    return root


def test_retries_while_a_writer_keeps_the_tree_non_empty(tmp_path, monkeypatch):
    """Each rmtree that a still-running writer defeats fails with 'Directory not empty' (here the first three, each
    leaving a new file behind); the next attempt after the writer stops removes the tree."""
    root = _tree(tmp_path / "tree")
    real, calls = shutil.rmtree, []

    def rmtree(path):
        calls.append(path)
        if len(calls) <= 3:
            (root / "a" / "logs" / f"new{len(calls)}.log").write_text("x")
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(root / "a" / "logs"))
        real(path)

    monkeypatch.setattr(rt.shutil, "rmtree", rmtree)
    rt.remove_tree(root, timeout=5.0, interval=0.01)
    assert calls == [root] * 4 and not root.exists()


def test_a_file_that_vanishes_mid_removal_is_retried_and_a_missing_tree_is_no_error(tmp_path, monkeypatch):
    root = _tree(tmp_path / "tree")
    real, calls = shutil.rmtree, []

    def rmtree(path):  # an entry removed by its owner between the listing and the unlink
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(root / "a" / "logs" / "gone"))
        real(path)

    monkeypatch.setattr(rt.shutil, "rmtree", rmtree)
    rt.remove_tree(root, timeout=5.0, interval=0.01)
    assert len(calls) == 2 and not root.exists()
    rt.remove_tree(root)  # gone already: one attempt, no error
    assert len(calls) == 3


def test_gives_up_after_its_timeout_with_the_last_error(tmp_path, monkeypatch):
    root = _tree(tmp_path / "tree")
    calls = []

    def failing(path):
        calls.append(time.monotonic())
        raise OSError(errno.ENOTEMPTY, "Directory not empty")

    monkeypatch.setattr(rt.shutil, "rmtree", failing)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="Directory not empty"):
        rt.remove_tree(root, timeout=0.3, interval=0.05)
    assert 0.3 <= time.monotonic() - t0 < 2.0 and root.exists() and len(calls) >= 3
    with pytest.raises(OSError):  # timeout 0: one attempt
        rt.remove_tree(root, timeout=0.0)


def test_a_real_tree_with_a_symlink_out_of_it_is_removed_without_following_the_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    root = _tree(tmp_path / "tree")
    (root / "a" / "link").symlink_to(outside)
    rt.remove_tree(root)
    assert not root.exists() and (outside / "keep").read_text() == "x"


@pytest.mark.parametrize("timeout, interval", [(-1.0, 0.1), (1.0, 0.0)])
def test_degenerate_timing_is_refused(tmp_path, timeout, interval):
    with pytest.raises(ValueError, match="timeout must be >= 0 and interval > 0"):
        rt.remove_tree(tmp_path, timeout=timeout, interval=interval)
