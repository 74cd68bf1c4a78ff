"""Names shared by the PGVI server and clients on the wire (no flwr import here).

Train message (server -> client), one per selected node:
  "posterior"  ArrayRecord  natural parameters of the current server posterior
  "site"       ArrayRecord  OPTIONAL: the server ledger's copy of this client's site (resync)
  "config"     ConfigRecord server-round, posterior-version, rho, site-version (-1 = unknown node), seed,
                            posterior-layout (and site-layout with a site)
Train reply (client -> server):
  "delta"      ArrayRecord  Delta natural parameters (absent when status != "ok")
  "metrics"    MetricRecord num-examples, objective, epochs, seconds, ...
  "config"     ConfigRecord client-id, base-site-version, posterior-version, status, reason, delta-layout
Evaluate message: "posterior" + "config" (server-round, posterior-layout); reply: "metrics" (accuracy, nll,
ece, brier, num-examples).

Each ArrayRecord of natural parameters holds one packed Array, split by the JSON layout under
"<record>-layout" (strategies/codec.py); a record without a layout holds one Array per tensor.

Site versions make updates exactly-once: the server's ledger counts the updates it applied per client;
a client computes its Delta against the site of a given version and reports it; the server applies a
Delta only if that version equals the ledger's (a duplicate, late or lost-state reply does not), and
the client commits its pending site only when the server's next message confirms the new version.
"""

POSTERIOR = "posterior"
SITE = "site"
DELTA = "delta"
CONFIG = "config"
METRICS = "metrics"

STATUS_OK = "ok"
STATUS_RESYNC = "resync"  # the client's site does not match the ledger: resend it
STATUS_FAILED = "failed"  # the local step raised (improper cavity, non-finite objective, ...)

UNKNOWN_VERSION = -1
