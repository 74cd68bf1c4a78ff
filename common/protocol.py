"""Names shared by the PGVI server and clients on the wire (no flwr import here).

Train message (server -> client), one per selected node:
  "posterior"  ArrayRecord  natural parameters of the current server posterior
  "site"       ArrayRecord  OPTIONAL: the server ledger's copy of this client's site (resync)
  "config"     ConfigRecord client-id, server-round, posterior-version, rho, site-version (-1 = unknown node),
                            site-tag, has-site, posterior-layout (and site-layout with a site), round-message
                            (only on a later message to the client in the same round)
Train reply (client -> server):
  "delta"      ArrayRecord  Delta natural parameters (absent when status != "ok")
  "metrics"    MetricRecord num-examples, conjugate, epochs, seconds; objective, best-epoch, local-seconds (an
                            iterative local update only)
  "config"     ConfigRecord client-id, base-site-version, posterior-version, status, reason, update-tag,
                            delta-layout
Evaluate message: "posterior" + "config" (server-round, posterior-layout); reply: "metrics" (accuracy, nll,
ece, brier, num-examples).

Each ArrayRecord of natural parameters holds one packed Array, split by the JSON layout under
"<record>-layout" (strategies/codec.py); a record without a layout holds one Array per tensor.

Site versions make updates exactly-once: the server's ledger counts the updates it applied per client;
a client computes its Delta against the site of a given version and reports it; the server applies a
Delta only if that version equals the ledger's (a duplicate, late or lost-state reply does not), and
the client commits its pending site only when the server's next message confirms the new version.

Update tags tell apart two updates staged against the same version (two executions of one message, or two
messages of one node running at once): the client draws a random tag for each update it stages and reports it
("update-tag"); the server records the tag of the Delta it applies and sends it with every train message
("site-tag": the tag of the update that produced the ledger's current site, also with a resent site; "" when
unknown: never updated, site reset, or a reply without a tag).  A client whose pending update has the message's
version but another tag drops it and asks for its site (status "resync"); an empty site-tag leaves the decision
to the version, as before tags existed (common/client_state.py).
"""

from __future__ import annotations

import reprlib

POSTERIOR = "posterior"
SITE = "site"
DELTA = "delta"
CONFIG = "config"
METRICS = "metrics"

STATUS_OK = "ok"
STATUS_RESYNC = "resync"  # the client's site does not match the ledger: resend it
STATUS_FAILED = "failed"  # the local step raised (improper cavity, non-finite objective, ...)

UNKNOWN_VERSION = -1

#: train message config (asynchronous schedule): this is the client's n-th message of the round (absent: its first)
ROUND_MESSAGE = "round-message"
UPDATE_TAG = "update-tag"  # train reply config: the tag of the update the client staged
SITE_TAG = "site-tag"  # train message config: the tag of the update behind the ledger's site ("" = unknown)
MAX_TAG_CHARS = 64  # a longer (or non-string) update-tag makes a reply malformed

# The FedAvg baseline (client/fedavg_app.py -> strategies/fedavg_baseline.py): the keys of a train reply's one
# MetricRecord ("metrics"), exactly these; its one ArrayRecord ("arrays") holds the model's arrays by name
FEDAVG_TRAIN_METRICS = ("num-examples", "train-loss", "client-seconds", "epochs")


#: The longest client id a node may have.
MAX_CLIENT_ID_CHARS = 128
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxtuple = _SHORT.maxlist = 8


def short_repr(value: object) -> str:
    """A peer's name or shape in an error message, cut to a few dozen characters (messages are logged and
    checkpointed)."""
    return _SHORT.repr(value)


def client_id_problem(value: object) -> str | None:
    """Why ``value`` cannot be a node's ``client-id``, or ``None`` if it can: a non-empty string of at most
    :data:`MAX_CLIENT_ID_CHARS` printable characters (``str.isprintable``: no NUL, control, line-separator or
    unpaired surrogate characters, but any letter, digit, punctuation or space).

    The id keys the server's ledger and names the client's arrays in every checkpoint (``site|<id>|<array>``, a zip
    member name): a NUL cut the member name short (every checkpoint unloadable) and an id of more than 65,535
    bytes made the first checkpoint raise; it is also written into logs, where a newline would forge a line.  Checked
    by the node (``client.node_request.node_run_config``) and by the server on the node's identity reply.  The
    message quotes the value cut short."""
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_CLIENT_ID_CHARS:
        return f"has {len(value)} characters, more than {MAX_CLIENT_ID_CHARS}: {short_repr(value)}"
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        return f"{short_repr(value)} holds the non-printable character {bad!r} (U+{ord(bad):04X})"
    return None
