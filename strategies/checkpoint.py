"""Server checkpoints: the whole PGVI server state, written atomically after every applied update.

A checkpoint holds the posterior, the global site, every client's site (the ledger), its version and its update
tag (``common.protocol``), the round and position within it, the sampling RNG state, the rejections and the
metrics so far.  The round is two
numbers: ``round-completed``, the last round recorded, and ``round-applied``, the last round whose updates are
all in the ledger (synchronous: one more between a round's applied batch and its record; a resume records that
round instead of sending it again).  The RNG state is the one the first round a resume sends must start from
(:meth:`strategies.pgvi.PGVIStrategy.sampling_state_to_checkpoint`), not necessarily the current one.  It is written
*before* any client learns that its update was applied (that news travels in the next message), so a server
that dies at any point resumes with a ledger that every client can reconcile with: a client whose update
was applied but not checkpointed sees the older version and rolls back; nothing is lost or counted twice.

Resume: a new run with ``resume = "<dir>"`` loads ``<dir>/checkpoint.npz``; the run config must be the same
except for the keys in ``RESUME_FREE_KEYS``.  Keys added to the format after version 1 (``round-applied``,
``ledger-tags``) take their old meaning when absent, so older checkpoints still load (without tags every client
tag is unknown, and clients reconcile by version alone until their next applied update).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.atomic_io import atomic_save_npz, load_npz
from common.errors import PGVIError

if TYPE_CHECKING:
    from common.families import GaussianFactor
    from strategies.pgvi import PGVIStrategy

CHECKPOINT_FILE = "checkpoint.npz"
RESUME_FREE_KEYS = {
    "resume", "output-dir", "num-server-rounds", "round-timeout-s", "wait-for-clients-s", "object-pull-retry-s",
    "pipeline-evaluation",
}
_FORMAT = 1


class CheckpointMismatch(PGVIError):
    """The checkpoint does not belong to this run configuration."""


def _config_fingerprint(flat: dict) -> dict:
    return {k: v for k, v in sorted(flat.items()) if k not in RESUME_FREE_KEYS}


def save_checkpoint(strategy: PGVIStrategy, directory: str | os.PathLike) -> Path:
    """Atomically write ``directory/checkpoint.npz`` (temp file + fsync + rename + directory fsync)."""
    st = strategy.state
    assert st.posterior is not None and st.global_site is not None
    arrays: dict[str, np.ndarray] = {}
    arrays.update({f"posterior|{k}": v for k, v in st.posterior.to_numpy().items()})
    arrays.update({f"global|{k}": v for k, v in st.global_site.to_numpy().items()})
    for cid, site in st.sites.items():  # client ids may contain '|'; array names never do (read back by rsplit)
        site_arrays = site.to_numpy()
        assert not any("|" in k for k in site_arrays), sorted(site_arrays)
        arrays.update({f"site|{cid}|{k}": v for k, v in site_arrays.items()})
    meta = {
        "format": _FORMAT,
        "config": _config_fingerprint(strategy.cfg.to_flat()),
        "version": st.version,
        "ledger-versions": strategy.ledger_versions,
        "ledger-tags": strategy.ledger_tags,
        "resync": sorted(strategy.resync),
        "round-completed": strategy.round_completed,
        "round-applied": strategy.round_applied,
        "done-in-round": sorted(strategy.done_in_round),
        "rng": repr(strategy.sampling_state_to_checkpoint()),
        "rejections": strategy.rejections,
        "bad-replies": strategy.bad_replies,
        "history": strategy.history,
    }
    return atomic_save_npz(Path(directory) / CHECKPOINT_FILE, arrays, meta)


def load_checkpoint(strategy: PGVIStrategy, directory: str | os.PathLike) -> None:
    """Restore ``strategy``'s server state from ``directory/checkpoint.npz``.

    Everything is decoded and checked first (layouts, the posterior's properness, the ledger identity, the meta
    fields and the RNG state); the strategy is assigned only when all of it passed, so a checkpoint that fails to
    load leaves the strategy as it was."""
    import ast

    path = Path(directory) / CHECKPOINT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    arrays, meta = load_npz(path)
    if meta.get("format") != _FORMAT:
        raise CheckpointMismatch(f"checkpoint format {meta.get('format')} is not {_FORMAT}")
    ours = _config_fingerprint(strategy.cfg.to_flat())
    diff = sorted(k for k in set(ours) | set(meta["config"]) if ours.get(k) != meta["config"].get(k))
    if diff:
        raise CheckpointMismatch(f"run config differs from the checkpoint's in: {', '.join(diff)}")
    like = strategy.problem.prior

    # arrays are '<owner>|<array name>' and array names never hold '|' (a client id may): split at the last one,
    # so that the sites of clients 'a' and 'a|x' ('site|a|eta1', 'site|a|x|eta1') are told apart exactly
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        owner, sep, name = key.rpartition("|")
        if not sep or not (owner in ("posterior", "global") or owner.startswith("site|")):
            raise CheckpointMismatch(f"checkpoint holds an unexpected array {key!r}")
        groups.setdefault(owner, {})[name] = value
    posterior = like.from_numpy(groups.pop("posterior", {})).check_proper("checkpointed posterior")
    global_site = like.from_numpy(groups.pop("global", {}))
    sites = {owner[len("site|"):]: like.from_numpy(named) for owner, named in groups.items()}
    sites = {cid: sites[cid] for cid in sorted(sites)}

    version = int(meta["version"])
    ledger_versions = {k: int(v) for k, v in meta["ledger-versions"].items()}
    ledger_tags = {k: str(v) for k, v in meta.get("ledger-tags", {}).items() if v}  # absent: all unknown
    resync = set(meta["resync"])
    round_completed = int(meta["round-completed"])
    # absent from checkpoints written before it existed: resume those as their version did, at round-completed + 1
    round_applied = max(round_completed, int(meta.get("round-applied", round_completed)))
    done_in_round = set(meta["done-in-round"])
    rng_state = ast.literal_eval(meta["rng"])
    random.Random().setstate(rng_state)  # a malformed state raises here, not half-way through the assignment
    rejections = list(meta["rejections"])
    bad_replies = {k: int(v) for k, v in meta.get("bad-replies", {}).items()}  # exclusions survive a resume
    history = list(meta["history"])
    total = like.zeros_like()
    for site in sites.values():
        total = total * site
    if total.max_abs_diff(global_site) > _invariant_tolerance(global_site, sites, ledger_versions):
        raise CheckpointMismatch("checkpoint ledger is inconsistent: global site != product of sites")

    st = strategy.state
    st.posterior, st.global_site, st.sites, st.version = posterior, global_site, sites, version
    strategy.ledger_versions = ledger_versions
    strategy.ledger_tags = ledger_tags
    strategy.resync = resync
    strategy.round_completed = round_completed
    strategy.round_applied = round_applied
    strategy.done_in_round = done_in_round
    strategy.rng.setstate(rng_state)
    strategy.rejections = rejections
    strategy.bad_replies = bad_replies
    strategy.history = history
    strategy._posterior_record = None


def _invariant_tolerance(global_site: GaussianFactor, sites: dict[str, GaussianFactor],
                         ledger_versions: dict[str, int]) -> float:
    """How far the running global site may drift from the sum of the sites by rounding alone.

    The global site is accumulated one Delta at a time, the sum of the sites is recomputed: each of the n
    additions rounds by at most eps of the magnitudes involved, so the drift is bounded by about
    n * eps * scale.  A relative 1e-6 is the floor (float64); in float32 (eps 1.2e-7) a long run needs more.
    """
    factors = [global_site, *sites.values()]
    scale = max(1.0, *(float(v.abs().max()) for f in factors for v in f.params.values() if v.numel()))
    eps = torch.finfo(global_site.dtype).eps
    n = sum(ledger_versions.values()) + len(sites)
    return max(1e-6, 4.0 * n * eps) * scale
