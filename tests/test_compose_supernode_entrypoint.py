"""The SuperNode containers' entrypoint script (docker-compose.yml, ``x-supernode``), run for real.

There is no Docker engine here, so the script is run as PID 1 of a new PID namespace (``unshare --pid --fork``),
which is what it is in its container: PID 1 ignores every signal it has no handler for, also when the signal
comes from outside its namespace (``docker stop``).  ``flower-supernode`` is a stand-in on ``PATH`` that
records its arguments and the signals it receives.  Checked:

* a first start is immediate; a start after a crash waits ``SUPERNODE_RESTART_DELAY_S`` (the 305 gotcha);
* SIGTERM during the run is forwarded to the SuperNode, the script exits with its status and clears the marker,
  so the next start (``docker compose restart``) is immediate: a stopped SuperNode deactivated itself;
* SIGTERM during the restart delay stops the script at once (it waited out Docker's 10-s SIGKILL before) and
  keeps the marker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

FAKE_SUPERNODE = """#!/bin/sh
trap 'echo "got TERM" >> "$FAKE_LOG"; exit 0' TERM
echo "args: $*" >> "$FAKE_LOG"
if [ "$FAKE_MODE" = crash ]; then exit 1; fi
while :; do sleep 0.05; done
"""


def _unshare_prefix() -> list[str] | None:
    if shutil.which("unshare") is None:
        return None
    # --kill-child: unshare killed (a failed test) takes the namespace's PID 1, and with it everything in it
    for prefix in (["unshare", "--pid", "--kill-child"],
                   ["unshare", "--user", "--map-root-user", "--pid", "--kill-child"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


UNSHARE = _unshare_prefix()
pytestmark = pytest.mark.skipif(UNSHARE is None, reason="needs unshare --pid (a new PID namespace)")


def _entrypoint(marker: Path) -> list[str]:
    """The supernode entrypoint as the container runs it: Compose's ``$$`` is ``$``; the marker moved to tmp."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    entry = services["supernode-1"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and "/tmp/.pgvi-started" in entry[2]
    script = entry[2].replace("$$", "$").replace("/tmp/.pgvi-started", str(marker))
    return [entry[0], entry[1], script, *entry[3:]]


class Container:
    def __init__(self, tmp: Path, delay: float, mode: str = "run") -> None:
        bindir = tmp / "bin"
        bindir.mkdir(exist_ok=True)
        fake = bindir / "flower-supernode"
        fake.write_text(FAKE_SUPERNODE)
        fake.chmod(0o755)
        self.log = tmp / "fake.log"
        self.marker = tmp / "marker"
        env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", FAKE_LOG=str(self.log), FAKE_MODE=mode,
                   SUPERNODE_RESTART_DELAY_S=str(delay))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*UNSHARE, *_entrypoint(self.marker), "--insecure", "--node-config", "a=1"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pid1(self) -> int:
        """The script's pid seen from here (unshare's only child)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            if children:
                return int(children[0])
            time.sleep(0.01)
        raise AssertionError("the script did not start")

    def wait_for(self, text: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log.exists() and text in self.log.read_text():
                return
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not in the stand-in's log")

    def finish(self, timeout: float = 15.0) -> tuple[int, str, float]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, out, time.monotonic() - self.t0


def test_a_crash_leaves_the_marker_and_the_next_start_waits_out_the_old_session(tmp_path):
    first = Container(tmp_path, delay=30, mode="crash")
    code, out, took = first.finish()
    assert code == 1 and "waiting" not in out and took < 10  # a fresh container starts at once
    assert first.marker.exists()
    assert "args: --insecure --node-config a=1" in first.log.read_text()  # Compose's command passed through
    second = Container(tmp_path, delay=1.5, mode="crash")
    code, out, took = second.finish()
    assert code == 1 and "supernode restart after a crash: waiting 1.5s" in out and took >= 1.5


def test_sigterm_is_forwarded_and_a_stopped_supernode_restarts_at_once(tmp_path):
    c = Container(tmp_path, delay=30)
    c.wait_for("args:")
    os.kill(c.pid1(), signal.SIGTERM)
    t_sig = time.monotonic()
    code, out, _ = c.finish()
    assert time.monotonic() - t_sig < 5
    assert code == 0 and "got TERM" in c.log.read_text()
    assert not c.marker.exists()  # graceful: the node deactivated itself
    again = Container(tmp_path, delay=30, mode="crash")
    code, out, took = again.finish()
    assert "waiting" not in out and took < 10


def test_sigterm_during_the_restart_delay_stops_at_once_and_keeps_the_marker(tmp_path):
    (tmp_path / "marker").touch()  # the previous run crashed
    c = Container(tmp_path, delay=60)
    pid = c.pid1()
    deadline = time.monotonic() + 10  # the script has trapped TERM once it has started its sleep
    while time.monotonic() < deadline and not Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    t_sig = time.monotonic()
    code, out, _ = c.finish(timeout=20)
    assert time.monotonic() - t_sig < 5, "PID 1 ignored SIGTERM during the delay"
    assert code == 143 and "waiting 60s" in out
    assert (tmp_path / "marker").exists() and not c.log.exists()  # the SuperNode never started
