"""Per-round records of a PGVI run: ``metrics.jsonl``, ``metrics.csv`` and a table in the log."""

from __future__ import annotations

import csv
import io
import math
import os
from logging import INFO
from pathlib import Path

import numpy as np
from flwr.supercore import log

from common.atomic_io import STALE_TEMP_MIN_AGE_S, atomic_write, remove_stale_temp_files
from common.config import ConfigError
from common.families import GaussianFactor
from common.strict_json import dumps_json

_TABLE_COLUMNS = [
    ("round", "round", "{:>5.0f}"),
    ("applied", "applied", "{:>7.0f}"),
    ("rejected", "rejected", "{:>8.0f}"),
    ("test-accuracy", "test acc", "{:>8.4f}"),
    ("test-nll", "test nll", "{:>8.4f}"),
    ("test-ece", "test ece", "{:>8.4f}"),
    ("test-brier", "brier", "{:>7.4f}"),
    ("test-rmse", "rmse", "{:>7.4f}"),
    ("client-accuracy", "cli acc", "{:>7.4f}"),
    ("client-nll", "cli nll", "{:>7.4f}"),
    ("client-ece", "cli ece", "{:>7.4f}"),
    ("client-brier", "cli brier", "{:>9.4f}"),
    ("client-rmse", "cli rmse", "{:>8.4f}"),
    ("client-seconds-max", "cli s", "{:>6.2f}"),
    ("round-seconds", "round s", "{:>7.2f}"),
]


# The result files a finished run leaves (PGVI: ``finish``; FedAvg: strategies/fedavg_baseline.py; ``rescored.json``:
# scripts/experiments.py, from the final model).  ``summary.json`` first: its presence means the others are complete.
# The checkpoint (strategies/checkpoint.py) is not one of them: a run may resume from its own directory.
RESULT_FILES = ("summary.json", "metrics.csv", "posterior.npz", "sites.npz", "model.npz", "rescored.json")


def recorder_for(out_dir: str | Path, run_config: dict) -> RoundRecorder:
    """The run's :class:`RoundRecorder`, made before round 1: a directory that cannot be created or written is the
    run config's ``output-dir`` (:class:`~common.config.ConfigError` naming it), not an ``OSError`` traceback."""
    try:
        return RoundRecorder(out_dir, run_config)
    except OSError as err:
        raise ConfigError(f"invalid run config: output-dir: cannot write the run's records to {str(out_dir)!r}: "
                          f"{type(err).__name__}: {err.strerror or err}") from None


class RoundRecorder:
    """Appends one row per round; ``finish`` saves the final posterior, the ledger and the rejections.

    A reused output directory is cleared of the previous run's :data:`RESULT_FILES` first, so an unfinished run
    never leaves its ``run_config.json`` / ``metrics.jsonl`` beside another run's ``summary.json``."""

    def __init__(self, out_dir: str | Path, run_config: dict) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name in RESULT_FILES:
            (self.out_dir / name).unlink(missing_ok=True)
        for name in (*RESULT_FILES, "run_config.json"):  # a killed run's temp files (a fresh write's are spared)
            remove_stale_temp_files(self.out_dir / name, min_age_s=STALE_TEMP_MIN_AGE_S)
        self.rows: list[dict[str, float]] = []
        text = dumps_json(run_config, indent=2, sort_keys=True).encode()
        atomic_write(self.out_dir / "run_config.json", lambda f: f.write(text), mode=0o644)
        self._jsonl = self.out_dir / "metrics.jsonl"
        # a new file, never through a symlink left in a reused directory (it truncated the file it pointed to)
        self._jsonl.unlink(missing_ok=True)
        os.close(os.open(self._jsonl, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        self._columns_shown: list[tuple[str, str, str]] = []
        self._csv_keys: list[str] | None = None  # the columns of metrics.csv as last written in full

    def _columns(self, row: dict[str, float]) -> list[tuple[str, str, str]]:
        return [c for c in _TABLE_COLUMNS if c[0] in row]

    def record(self, rnd: int, row: dict[str, float]) -> None:
        self.rows.append(dict(row))
        # (re)created if an operator deleted it mid-run (log rotation): the rows from then on are kept
        with os.fdopen(os.open(self._jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a") as f:
            f.write(dumps_json(row) + "\n")
        self._update_csv(row)  # every round: a run that stops early (e.g. AllClientsFailed) still leaves its table
        cols = self._columns(row)
        if cols != self._columns_shown:
            log(INFO, "PGVI | " + " ".join(f"{h:>{len(fmt.format(0.0))}}" for _, h, fmt in cols))
            self._columns_shown = cols
        cells = []
        for key, _, fmt in cols:
            v = row.get(key, math.nan)
            cells.append(fmt.format(v))
        log(INFO, "PGVI | " + " ".join(cells))

    def finish(self, posterior: GaussianFactor, sites: dict[str, GaussianFactor], extra: dict) -> None:
        """Write the run's result files, each atomically (a crash leaves the old file or none, never a torn
        one); ``summary.json`` last, so that its presence means the others are complete."""
        self.write_csv()
        arrays = posterior.to_numpy()
        atomic_write(self.out_dir / "posterior.npz", lambda f: np.savez(f, **arrays), mode=0o644)
        ledger = {f"{cid}|{k}": v for cid, s in sites.items() for k, v in s.to_numpy().items()}
        atomic_write(self.out_dir / "sites.npz", lambda f: np.savez(f, **ledger), mode=0o644)
        text = dumps_json(extra, indent=2, default=str).encode()
        atomic_write(self.out_dir / "summary.json", lambda f: f.write(text), mode=0o644)

    def _update_csv(self, row: dict[str, float]) -> None:
        """Append ``row`` to ``metrics.csv`` while its columns are the file's; rewrite the file (atomically) when
        a new column appears.  Rewriting every round cost O(rounds^2): 35 s over 1,000 rounds of 40 keys.  An
        appended line is not fsync'd; :meth:`finish` rewrites the whole file atomically."""
        if self._csv_keys is not None and set(row) <= set(self._csv_keys):
            buf = io.StringIO(newline="")
            csv.DictWriter(buf, fieldnames=self._csv_keys).writerow(row)
            with (self.out_dir / "metrics.csv").open("a", newline="") as f:
                f.write(buf.getvalue())
        else:
            self.write_csv()

    def write_csv(self) -> None:
        keys = sorted({k for r in self.rows for k in r}, key=lambda k: (k != "round", k))
        self._csv_keys = keys
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        for r in self.rows:
            w.writerow(r)
        data = buf.getvalue().encode()
        atomic_write(self.out_dir / "metrics.csv", lambda f: f.write(data), mode=0o644)
