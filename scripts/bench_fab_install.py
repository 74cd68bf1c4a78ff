"""What a forked ClientApp spends installing this project's FAB per message: Flower's ``install_from_fab`` against
``client.fab_cache`` (``docs/bench_network.md`` section 4c).

Builds the FAB with ``flwr build`` (the repository's ``fab-exclude`` applies) into a temporary directory, installs
it once into a temporary ``FLWR_HOME``, then times, alternating in this one process, Flower's function (which
extracts and verifies the whole FAB each time before finding it installed, as ``run_clientapp`` does for every
message) and the cached one.  Prints medians of wall and CPU milliseconds per call.

Run:  .venv/bin/python scripts/bench_fab_install.py [--calls 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.arg_types import int_at_least  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int_at_least(1, " (calls timed per round)"), default=30,
                    help="calls per function and round (median reported)")
    ap.add_argument("--rounds", type=int_at_least(1, " (rounds)"), default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FLWR_HOME"] = str(Path(tmp) / "flwr-home")
        flwr = Path(sys.executable).parent / "flwr"
        res = subprocess.run([str(flwr), "build", "--app", str(ROOT)], cwd=tmp, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"flwr build failed:\n{res.stdout}{res.stderr}")
        (fab_file,) = Path(tmp).glob("*.fab")
        fab = fab_file.read_bytes()

        from flwr.cli.install import install_from_fab
        from flwr.supercore.utils import get_flwr_home

        from client.fab_cache import make_cached_install

        cached = make_cached_install(install_from_fab, get_flwr_home)
        with contextlib.redirect_stdout(io.StringIO()):
            installed = install_from_fab(fab, skip_prompt=True)  # installed once, as on a node after message 1

        def timed(fn) -> tuple[float, float]:
            wall, cpu = [], []
            for _ in range(args.calls):
                w0, c0 = time.perf_counter(), time.process_time()
                with contextlib.redirect_stdout(io.StringIO()):
                    assert fn(fab, skip_prompt=True) == installed
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
            return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)

        n_files = len(__import__("zipfile").ZipFile(fab_file).infolist())
        print(f"FAB {fab_file.name}: {len(fab) / 1e3:.0f} kB, {n_files} files; load average {os.getloadavg()}")
        for r in range(args.rounds):
            fw, fc = timed(install_from_fab)
            cw, cc = timed(cached)
            print(f"round {r + 1}: Flower's install_from_fab {fw:.2f} ms wall / {fc:.2f} ms CPU per call; "
                  f"client.fab_cache {cw:.3f} ms wall / {cc:.3f} ms CPU ({fc / cc:.0f}x less CPU)")


if __name__ == "__main__":
    main()
