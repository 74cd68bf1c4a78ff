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
except for the keys in ``RESUME_FREE_KEYS``; a key the checkpoint does not hold (it was written before the key
existed) matches when this run leaves it at its default.  Keys added to the format after version 1
(``round-applied``, ``ledger-tags``) take their old meaning when absent, so older checkpoints still load (without
tags every client tag is unknown, and clients reconcile by version alone until their next applied update).  A file
that is not a readable checkpoint of this run (foreign config, damaged header or arrays, inconsistent ledger) is a
:class:`CheckpointMismatch` naming the file.

A client's arrays are stored as ``site|<client id>|<array name>`` (zip member names): array names never hold ``|``,
so the id is what lies between the first and the last ``|``; client ids are bounded printable strings
(``common.protocol.client_id_problem``, checked when a node identifies itself).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.atomic_io import STALE_TEMP_MIN_AGE_S, atomic_save_npz, load_npz, remove_stale_temp_files
from common.errors import PGVIError
from common.factors import product_of_sites
from strategies.codec import _short

if TYPE_CHECKING:
    from common.families import GaussianFactor
    from strategies.pgvi import PGVIStrategy

CHECKPOINT_FILE = "checkpoint.npz"
#: The run-config keys a resumed run may set differently from the checkpoint's run.  None of them changes the
#: server state a checkpoint holds, nor what a client computes from the messages it is sent:
#:
#: * ``resume``, ``output-dir``, ``checkpoint``: where the run reads and writes its records, and whether it
#:   writes checkpoints;
#: * ``num-server-rounds``, ``round-timeout-s``, ``wait-for-clients-s``, ``object-pull-retry-s``: how long the run
#:   goes on and how long it waits for clients and replies;
#: * ``pipeline-evaluation``: when a round's server evaluation runs (the records are the same);
#: * ``eval-samples``: the Monte Carlo samples of the test metrics (server and client evaluation); the rounds
#:   recorded after the resume are measured with the new count;
#: * ``torch-threads``: the server's and the clients' default number of torch threads (speed; sums may round
#:   differently in the last bits).
#:
#: Every other key is part of the run and must match, ``data-dir`` included (it decides the clients' data) and
#: ``evaluate-clients`` (it decides what each round records).
RESUME_FREE_KEYS = {
    "resume", "output-dir", "checkpoint", "num-server-rounds", "round-timeout-s", "wait-for-clients-s",
    "object-pull-retry-s", "pipeline-evaluation", "eval-samples", "torch-threads",
}
_FORMAT = 1
_ZIP_NAME_BYTES = 65_535  # a zip member name's length field is 16 bits
_ABSENT = object()


class CheckpointMismatch(PGVIError):
    """The checkpoint does not belong to this run configuration, or is not a readable checkpoint."""


def _cut(text: str, limit: int = 200) -> str:
    """An error's text in a :class:`CheckpointMismatch`, cut to ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def _mismatch(path: Path, what: str) -> CheckpointMismatch:
    """The error for checkpoint file ``path`` that cannot be resumed from: ``what``, then the file."""
    return CheckpointMismatch(f"{what} [{path}]")


def _config_fingerprint(flat: dict) -> dict:
    return {k: v for k, v in sorted(flat.items()) if k not in RESUME_FREE_KEYS}


def _config_defaults() -> dict[str, object]:
    """Every run-config key's default (``common.config.RunConfig``), by its hyphenated name."""
    from common.config import RunConfig

    return {(f.alias or name): f.get_default(call_default_factory=True) for name, f in RunConfig.model_fields.items()}


#: Keys added with a default that changed the behaviour, and the value that keeps the behaviour from before them:
#: what a checkpoint written before the key existed ran with (``batch-halvings``: a jointly failing batch was
#: rejected at once; only a synchronous run has batches, and with another schedule the key must stay at its
#: default, so there the default is the match)
LEGACY_VALUES: dict[str, object] = {"batch-halvings": 0}
_LEGACY_ONLY_IF = {"batch-halvings": ("schedule", "synchronous")}


def _legacy_value(key: str, theirs: dict, default: object) -> object:
    """The value of ``key`` that matches a checkpoint (config ``theirs``) written before the key existed."""
    if key not in LEGACY_VALUES:
        return default
    cond = _LEGACY_ONLY_IF.get(key)
    if cond is not None and theirs.get(cond[0], _config_defaults().get(cond[0])) != cond[1]:
        return default
    return LEGACY_VALUES[key]


def _config_differences(ours: dict, theirs: dict) -> list[str]:
    """The keys in which this run's config fingerprint differs from the checkpoint's, each with both values.  A key
    the checkpoint does not hold was added after it was written: it matches when this run sets it to the value that
    keeps the behaviour from before it, what the checkpoint's run did without knowing the key: its default, or for
    a key whose default changed the behaviour its :data:`LEGACY_VALUES` entry; any other value differs, and so does
    a key this run does not know (a newer checkpoint's)."""
    defaults = _config_defaults()
    out = []
    for k in sorted(set(ours) | set(theirs)):
        mine, stored = ours.get(k, _ABSENT), theirs.get(k, _ABSENT)
        if stored is _ABSENT:
            before = _legacy_value(k, theirs, defaults.get(k, _ABSENT))
            if mine == before:
                continue
            what = "its default" if before is defaults.get(k, _ABSENT) else "the behaviour before it"
            stored_text = f"absent (written before the key existed: {what}, {_short(before)})"
        elif mine == stored:
            continue
        else:
            stored_text = _short(stored)
        mine_text = "unknown to this version" if mine is _ABSENT else _short(mine)
        out.append(f"{k} (checkpoint: {stored_text}; this run: {mine_text})")
    return out


#: Age (s) below which a checkpoint temp file in the directory a run resumes from is kept: that directory may be a
#: live run's (a resume of a run that is still going), whose write in progress must not lose its temp file; a
#: checkpoint write takes about a second per 100 MB.
RESUME_TEMP_MIN_AGE_S = STALE_TEMP_MIN_AGE_S


def remove_stale_temp_checkpoints(directory: str | os.PathLike, min_age_s: float = 0.0) -> tuple[int, int]:
    """Delete the temp files a server killed while writing ``directory``'s checkpoint left there (named as
    ``common.atomic_io`` names them for ``checkpoint.npz``, nothing else, at least ``min_age_s`` old); ``(files,
    bytes)`` removed.  Called when a strategy starts: for the directory it writes to (no other server may write
    there: two servers on one checkpoint overwrite each other anyway) and, with :data:`RESUME_TEMP_MIN_AGE_S`, for
    the one it resumes from."""
    return remove_stale_temp_files(Path(directory) / CHECKPOINT_FILE, min_age_s)


def _site_members(cid: str, site_arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``site|<cid>|<array>`` for each of a site's arrays, checked to survive a zip member name exactly."""
    assert not any("|" in k for k in site_arrays), sorted(site_arrays)
    out = {f"site|{cid}|{k}": v for k, v in site_arrays.items()}
    for name in out:
        why = None
        if "\x00" in name:
            why = "holds a NUL character (a zip member name ends at it)"
        else:
            try:
                if len(name.encode("utf-8")) + len(".npy") > _ZIP_NAME_BYTES:
                    why = f"makes a zip member name longer than {_ZIP_NAME_BYTES} bytes"
            except UnicodeEncodeError:
                why = "is not encodable as UTF-8"
        if why is not None:
            raise PGVIError(f"cannot checkpoint client id {_short(cid)}: it {why}")
    return out


def save_checkpoint(strategy: PGVIStrategy, directory: str | os.PathLike) -> Path:
    """Atomically write ``directory/checkpoint.npz`` (temp file + fsync + rename + directory fsync)."""
    st = strategy.state
    assert st.posterior is not None and st.global_site is not None
    arrays: dict[str, np.ndarray] = {}
    arrays.update({f"posterior|{k}": v for k, v in st.posterior.to_numpy().items()})
    arrays.update({f"global|{k}": v for k, v in st.global_site.to_numpy().items()})
    for cid, site in st.sites.items():  # client ids may contain '|'; array names never do (read back by rsplit)
        arrays.update(_site_members(cid, site.to_numpy()))
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
        "async-resolved": strategy.async_resolved,
        "async-messages": strategy.async_messages,
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
    load leaves the strategy as it was.  A missing file is a ``FileNotFoundError``; anything else that keeps it
    from loading is a :class:`CheckpointMismatch` naming the file."""
    path = Path(directory) / CHECKPOINT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        arrays, meta = load_npz(path)
    except Exception as err:  # not a zip, no header, a header that is no JSON, an unreadable member
        raise _mismatch(path, f"not a readable checkpoint: {type(err).__name__}: {_cut(str(err))}") from None
    if not isinstance(meta, dict):
        raise _mismatch(path, f"damaged header: a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != _FORMAT:
        raise _mismatch(path, f"checkpoint format {_short(meta.get('format'))} is not {_FORMAT}")
    if not isinstance(meta.get("config"), dict):
        raise _mismatch(path, "damaged header: 'config' is missing or not an object")
    # both sides without the free keys: a checkpoint written before a key was made free still holds it
    diff = _config_differences(_config_fingerprint(strategy.cfg.to_flat()), _config_fingerprint(meta["config"]))
    if diff:
        raise _mismatch(path, f"run config differs from the checkpoint's in: {', '.join(diff)}")
    try:
        posterior, global_site, sites = _decode_arrays(strategy, arrays)
    except PGVIError as err:  # a stray array; a layout, dtype or value the prior does not take; an improper posterior
        raise _mismatch(path, str(err)) from None
    try:
        header = _parse_header(meta)
    except Exception as err:  # a missing key, a value of the wrong type, a malformed RNG state
        what = f"missing key {_cut(str(err))}" if isinstance(err, KeyError) else \
            f"{type(err).__name__}: {_cut(str(err))}"
        raise _mismatch(path, f"damaged header: {what}") from None
    total = product_of_sites(sites.values(), strategy.problem.prior)
    if total.max_abs_diff(global_site) > _invariant_tolerance(global_site, sites, header["ledger_versions"]):
        raise _mismatch(path, "checkpoint ledger is inconsistent: global site != product of sites")
    # the posterior is the server step of prior and global site (eq. 7): a stored one that is not (a damaged or
    # edited file; proper, so the check above passes it) would be sent to clients until the next applied update
    try:
        expected = strategy.state.server_step(strategy.problem.prior, global_site)
    except PGVIError as err:
        raise _mismatch(path, f"the server step of the checkpoint's global site fails: {_cut(str(err))}") from None
    if not expected.max_abs_diff(posterior) <= _POSTERIOR_TOLERANCE * _magnitude([expected]):
        raise _mismatch(path, "checkpointed posterior != the server step of the prior and the global site "
                              f"(max difference {expected.max_abs_diff(posterior):.3g} in natural parameters)")

    st = strategy.state
    st.posterior, st.global_site, st.sites, st.version = posterior, global_site, sites, header["version"]
    strategy.ledger_versions = header["ledger_versions"]
    strategy.ledger_tags = header["ledger_tags"]
    strategy.resync = header["resync"]
    strategy.round_completed = header["round_completed"]
    strategy.round_applied = header["round_applied"]
    strategy.done_in_round = header["done_in_round"]
    strategy.async_resolved = header["async_resolved"]
    strategy.async_messages = header["async_messages"]
    strategy.rng.setstate(header["rng_state"])
    strategy.rejections = header["rejections"]
    strategy.bad_replies = header["bad_replies"]
    strategy.history = header["history"]
    strategy._posterior_record = None


#: relative difference allowed between a checkpoint's posterior and the server step recomputed on load: the step is
#: deterministic, but an iterative one (Fisher-Rao, Alpha-Renyi by optimisation) may end a rounding apart when the
#: process resuming runs torch with other threads
_POSTERIOR_TOLERANCE = 1e-4


def _decode_arrays(strategy: PGVIStrategy, arrays: dict[str, np.ndarray]
                   ) -> tuple[GaussianFactor, GaussianFactor, dict[str, GaussianFactor]]:
    """The checkpoint's posterior (checked proper), global site and sites, in the layout of the problem's prior."""
    like = strategy.problem.prior
    # arrays are '<owner>|<array name>' and array names never hold '|' (a client id may): split at the last one,
    # so that the sites of clients 'a' and 'a|x' ('site|a|eta1', 'site|a|x|eta1') are told apart exactly
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        owner, sep, name = key.rpartition("|")
        if not sep or not (owner in ("posterior", "global") or owner.startswith("site|")):
            raise CheckpointMismatch(f"checkpoint holds an unexpected array {_short(key)}")
        groups.setdefault(owner, {})[name] = value

    def decode(owner: str, what: str) -> GaussianFactor:
        try:
            return like.from_numpy(groups.get(owner, {}))
        except PGVIError as err:
            raise CheckpointMismatch(f"{what}: {err}") from None

    posterior = decode("posterior", "posterior").check_proper("checkpointed posterior")
    global_site = decode("global", "global site")
    sites = {owner[len("site|"):]: decode(owner, f"site of client {_short(owner[len('site|'):])}")
             for owner in groups if owner.startswith("site|")}
    return posterior, global_site, {cid: sites[cid] for cid in sorted(sites)}


def _str_keyed(value: object, key: str) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"'{key}' is a {type(value).__name__}, not an object")
    return value


def _count(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"'{key}' holds {_cut(repr(value))}, not a count (a whole number >= 0)")
    return value


def _listed(value: object, key: str) -> list:
    if not isinstance(value, list):
        raise TypeError(f"'{key}' is a {type(value).__name__}, not a list")
    return value


def _parse_header(meta: dict) -> dict[str, Any]:
    """The server state fields of a checkpoint's JSON header, converted and checked (raises on anything damaged:
    a missing key, a value of the wrong type, an RNG state ``random.Random`` does not take)."""
    import ast

    round_completed = int(meta["round-completed"])
    rng_state = ast.literal_eval(meta["rng"])
    random.Random().setstate(rng_state)  # a malformed state raises here, not half-way through the assignment
    return {
        "version": int(meta["version"]),
        "ledger_versions": {str(k): int(v) for k, v in _str_keyed(meta["ledger-versions"], "ledger-versions").items()},
        # absent: every tag unknown
        "ledger_tags": {str(k): str(v) for k, v in _str_keyed(meta.get("ledger-tags", {}), "ledger-tags").items() if v},
        "resync": set(_listed(meta["resync"], "resync")),
        "round_completed": round_completed,
        # absent from checkpoints written before it existed: resume those as their version did, at round-completed + 1
        "round_applied": max(round_completed, int(meta.get("round-applied", round_completed))),
        "done_in_round": set(_listed(meta["done-in-round"], "done-in-round")),
        # absent from checkpoints written before they existed: the open asynchronous round starts from nothing
        "async_resolved": _count(meta.get("async-resolved", 0), "async-resolved"),
        "async_messages": {str(k): _count(v, "async-messages")
                           for k, v in _str_keyed(meta.get("async-messages", {}), "async-messages").items()},
        "rng_state": rng_state,
        "rejections": list(_listed(meta["rejections"], "rejections")),
        # exclusions survive a resume
        "bad_replies": {str(k): int(v) for k, v in _str_keyed(meta.get("bad-replies", {}), "bad-replies").items()},
        "history": _history(meta["history"], round_completed),
    }


def _history(value: object, round_completed: int) -> list[dict]:
    """The checkpoint's round rows: objects whose ``round`` is a whole number, increasing, at most
    ``round-completed`` (a resumed run replays them into its records before round 1)."""
    rows = _listed(value, "history")
    last = -1
    for row in rows:
        rnd = row.get("round") if isinstance(row, dict) else None
        if isinstance(rnd, bool) or not isinstance(rnd, (int, float)) or rnd != int(rnd) \
                or not last < rnd <= round_completed:
            raise ValueError(f"'history' has a row {_cut(repr(row))} that is not an object with a whole 'round' "
                             f"after {last} and at most round-completed {round_completed}")
        last = int(rnd)
    return list(rows)


def _invariant_tolerance(global_site: GaussianFactor, sites: dict[str, GaussianFactor],
                         ledger_versions: dict[str, int]) -> float:
    """How far the running global site may drift from the sum of the sites by rounding alone.

    The global site is accumulated one Delta at a time, the sum of the sites is recomputed: each of the n
    additions rounds by at most eps of the magnitudes involved, so the drift is bounded by about
    n * eps * scale.  A relative 1e-6 is the floor (float64); in float32 (eps 1.2e-7) a long run needs more.
    """
    eps = torch.finfo(global_site.dtype).eps
    n = sum(ledger_versions.values()) + len(sites)
    return max(1e-6, 4.0 * n * eps) * _magnitude([global_site, *sites.values()])


def _magnitude(factors: list[GaussianFactor]) -> float:
    """The largest absolute natural parameter of ``factors``, at least 1: the scale a tolerance is relative to."""
    return max(1.0, *(float(v.abs().max()) for f in factors for v in f.params.values() if v.numel()))
