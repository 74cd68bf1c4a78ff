"""A client's durable PGVI state: its site (committed) and an update awaiting the server's confirmation.

The server's ledger is the source of truth.  After a client computes ``t' = t * Delta`` it keeps ``t'`` as
*pending*; the server's next message carries the ledger's version of this client's site, and the client
commits (the server applied the Delta), rolls back (it did not: the reply was lost or rejected), or, if
the versions make no sense (restart, lost disk), asks for a resync and adopts the ledger's site.

Versions alone cannot tell two updates staged against the same version apart: two train messages of one node may
execute at once (the server timed the first out and sent another) or one may execute twice, each stages its own
``t * Delta`` as version v + 1, the last save wins, and the server may have applied the other one.  So each
staged update carries a random *tag* that the train reply reports; the server echoes the tag of the update that
produced the ledger's current site (``site-tag``, ``common.protocol``).  A pending update is committed only if
the tags agree, a committed site is kept only if its tag agrees; otherwise the client asks for its ledger site
(resync).  An empty tag from the server (an older server or checkpoint, or a site reset) means "unknown": the
version decides alone, as before tags existed.

Persisted, when a directory is given, as one ``<client-id>.npz`` (:meth:`ClientState.path_for`: an id with other
characters than ``[A-Za-z0-9_.-]`` percent-encoded) written atomically (temp file + fsync + rename + directory
fsync), so a SuperNode restart resumes where it was.  A file that cannot be read (torn by a bad disk, truncated,
edited) is moved aside to ``<client-id>.npz.corrupt`` with a WARNING and the client starts from a fresh state
(version 0): the server's next message then makes it ask for its ledger site (resync), as after a lost disk.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.atomic_io import STALE_TEMP_MIN_AGE_S, atomic_save_npz, load_npz, remove_stale_temp_files
from common.protocol import UNKNOWN_VERSION, client_id_problem

_SAFE_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")  # as the file name itself (length: client_id_problem)
#: the longest percent-encoded client id used as a file name as it is (then its SHA-256)
_MAX_NAME = 200
#: What reading a torn or foreign state file can raise: the zip layer (BadZipFile, EOFError, OSError), numpy's .npy
#: reader (ValueError, EOFError; "pickled data" for bytes that are no zip), the JSON header (ValueError:
#: JSONDecodeError, UnicodeDecodeError), a missing header (KeyError) or a header of the wrong shape (TypeError,
#: AttributeError, ValueError in ``from_arrays``).
_UNREADABLE = (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile)
#: OSErrors that say nothing about the file's bytes (no permission, out of file descriptors or memory): raised as
#: they are, not taken for a corrupt file.
_ENVIRONMENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE, errno.ENOMEM})

log = logging.getLogger("flwr")  # Flower's logger: the ClientApp's own lines


@dataclass
class ClientState:
    site: dict[str, np.ndarray] | None = None  # None: the uniform site (never updated)
    version: int = 0
    pending_site: dict[str, np.ndarray] | None = None
    pending_version: int | None = None
    tag: str = ""  # the tag of the update that produced ``site`` ("" = unknown: uniform, or from an older peer)
    pending_tag: str = ""  # the tag of the pending update, reported in its train reply

    # -------------------------------------------------------------------------------------------
    def reconcile(self, ledger_version: int, ledger_site: dict[str, np.ndarray] | None, ledger_tag: str = "") -> bool:
        """Bring the committed site in line with the server's ledger.

        ``ledger_tag`` is the tag of the update that produced the ledger's site ("" = unknown: the versions
        decide alone).  Returns ``True`` if the committed site is now the ledger's (the caller may compute a
        Delta), ``False`` if the client cannot tell and must ask the server to resend the site.
        """
        if ledger_site is not None:
            self.site = {k: np.array(v, copy=True) for k, v in ledger_site.items()}
            self.version = int(ledger_version)
            self.tag = str(ledger_tag)
            self._drop_pending()
            return True
        if ledger_version == UNKNOWN_VERSION:
            # the server does not know this node yet; safe only if nothing is pending
            return self.pending_site is None
        if self.pending_version is not None and ledger_version == self.pending_version:
            if ledger_tag and ledger_tag != self.pending_tag:
                # the server applied another update of this client at this version (a concurrent or re-executed
                # message): neither the pending site nor the committed one is the ledger's
                self._drop_pending()
                return False
            self.site, self.version, self.tag = self.pending_site, self.pending_version, self.pending_tag  # commit
            self._drop_pending()
            return True
        if ledger_version == self.version:
            self._drop_pending()  # roll back: the server did not apply it
            return not ledger_tag or ledger_tag == self.tag  # else the ledger's site of this version is another
        return False

    def _drop_pending(self) -> None:
        self.pending_site, self.pending_version, self.pending_tag = None, None, ""

    def stage(self, new_site: dict[str, np.ndarray], tag: str | None = None) -> str:
        """Keep ``new_site`` as the pending update (version + 1) until the server confirms it; returns its tag (a
        fresh random one unless ``tag`` is given: a re-staged update that keeps the tag its reply reports)."""
        self.pending_site = {k: np.array(v, copy=True) for k, v in new_site.items()}
        self.pending_version = self.version + 1
        self.pending_tag = secrets.token_hex(8) if tag is None else str(tag)
        return self.pending_tag

    # -------------------------------------------------------------------------------------------
    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, int | bool | str]]:
        arrays: dict[str, np.ndarray] = {}
        for prefix, d in (("site:", self.site), ("pending:", self.pending_site)):
            for k, v in (d or {}).items():
                arrays[prefix + k] = v
        meta = {
            "version": self.version,
            "has-site": self.site is not None,
            "pending-version": -1 if self.pending_version is None else self.pending_version,
            "tag": self.tag,
            "pending-tag": self.pending_tag if self.pending_version is not None else "",
        }
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict) -> ClientState:
        site = {k[5:]: v for k, v in arrays.items() if k.startswith("site:")}
        pending = {k[8:]: v for k, v in arrays.items() if k.startswith("pending:")}
        pv = int(meta.get("pending-version", -1))
        return cls(
            site=site if meta.get("has-site") else None,
            version=int(meta.get("version", 0)),
            pending_site=pending if pv >= 0 else None,
            pending_version=pv if pv >= 0 else None,
            tag=str(meta.get("tag", "")),  # absent from states saved before tags existed
            pending_tag=str(meta.get("pending-tag", "")) if pv >= 0 else "",
        )

    # -------------------------------------------------------------------------------------------
    @staticmethod
    def path_for(state_dir: str | os.PathLike, client_id: str) -> Path:
        """``<state_dir>/<client-id>.npz`` for an id of ``[A-Za-z0-9_.-]``; any other id the node accepts (printable,
        at most 128 characters: ``site 3``, ``Hôpital-3``, ``a/b``) is percent-encoded (UTF-8; injective, and its
        name has a ``%`` or ``~``, so it never meets a plain id's), or, if that is longer than :data:`_MAX_NAME`
        characters, ``%sha256-<hex of the UTF-8 id>``: a file name without a separator, within the usual 255-byte
        limit."""
        if (why := client_id_problem(client_id)) is not None:  # the node's own rule: what it refuses has no file
            raise ValueError(f"client-id {why}")
        if _SAFE_ID.match(client_id):
            return Path(state_dir) / f"{client_id}.npz"
        name = urllib.parse.quote(client_id, safe="")
        if len(name) > _MAX_NAME:
            name = "%sha256-" + hashlib.sha256(client_id.encode("utf-8")).hexdigest()
        return Path(state_dir) / f"{name}.npz"

    def save(self, state_dir: str | os.PathLike, client_id: str) -> Path:
        arrays, meta = self.to_arrays()
        return atomic_save_npz(self.path_for(state_dir, client_id), arrays, meta)

    @classmethod
    def load(cls, state_dir: str | os.PathLike, client_id: str) -> ClientState:
        """The state saved for ``client_id``; a fresh one if there is none, or if the file cannot be read: then it
        is moved aside to ``<client-id>.npz.corrupt`` (one WARNING) and the server's ledger restores the site."""
        path = cls.path_for(state_dir, client_id)
        remove_stale_temp_files(path, min_age_s=STALE_TEMP_MIN_AGE_S)  # a save killed mid-write left its temp file
        if not path.exists():
            return cls()
        try:
            arrays, meta = load_npz(path)
            return cls.from_arrays(arrays, meta)
        except FileNotFoundError:  # removed since the check: as if it had never been there
            return cls()
        except _UNREADABLE as err:
            if isinstance(err, OSError) and err.errno in _ENVIRONMENT_ERRNOS:
                raise
            aside = path.with_name(path.name + ".corrupt")
            try:
                os.replace(path, aside)
                moved = f"moved it to {aside}"
            except OSError as move_err:
                moved = f"could not move it aside to {aside} ({type(move_err).__name__}: {move_err})"
            log.warning(
                "pgvi-client: the client state file %s cannot be read (%s: %s); %s and starting from a fresh "
                "state (version 0): the server resends this client's site", path, type(err).__name__, err, moved,
            )  # fmt: skip
            return cls()
