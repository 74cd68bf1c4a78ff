"""The PGVI server as a Flower Strategy (Message API).

The strategy holds the prior, the global loss approximation ``exp(-l_s)`` (the product of the sites), the
ledger of every client's site keyed by the client's *stable* id (``client-id`` from its node config, learnt
through a ``query`` message; node ids change when a SuperNode restarts), the server divergence step and the
current posterior.  It sends each selected client the posterior's natural parameters and the version of that
client's site in the ledger, receives Deltas, validates them and applies them:

* ``synchronous``: sample a fraction of the clients, apply the batch of Deltas atomically (a batch whose Deltas are
  valid one by one but not together is retried with their damping halved, up to ``batch-halvings`` times);
* ``sequential``: one client at a time in a fixed order (rho = 1 by default);
* ``asynchronous``: one message in flight per client; apply each Delta on arrival, re-dispatch at once,
  record its staleness (posterior versions elapsed) and reject updates staler than ``max-staleness``.

A Delta is applied only if it decodes to the right names/shapes/dtypes, is finite, was computed against
the ledger's version of the client's site, keeps the posterior proper, and (async) is fresh enough.
Otherwise it is rejected with a logged reason, counted in the round's metrics, and the state is unchanged;
the client then rolls its pending site back (see ``common.client_state``).  A client that fails or times out
keeps its old site and the run continues; it stops (:class:`AllClientsFailed`) when the latest message of every
usable client (connected, identified, not excluded) failed and no update was applied since: with every client in
each round, when every client of a round failed; with ``fraction-train`` < 1, not when the few clients sampled in
one round failed while others are healthy.  A batch that only the combination of its Deltas makes invalid is
rejected whole without charging any client a bad reply.

Runtime API calls (push/pull) that fail transiently (HTTP 5xx, 408, 429, a dropped connection, an expired
object-push session) are retried with a short backoff until the round deadline; only then are the messages
treated as failed.  A push is retried with the *same* ``Message`` objects: their id is the content hash, so the
SuperLink stores (and delivers) at most one copy even if the failed attempt was stored; a message that is
nonetheless executed twice yields two Deltas against the same site version, and the ledger applies one; the
applied reply's ``update-tag`` becomes the client's ledger tag (``ledger_tags``, checkpointed), sent with its next
messages as ``site-tag``, so the client commits only the update the ledger applied (``common.client_state``).
Duplicates and version mismatches are rejected without counting towards ``max-bad-replies`` (they are not
misbehaviour); invalid content (non-finite, wrong shape, improper) does count, once per message it answers. A reply
whose client id is not the one its node gave is not charged either: the node is asked for its identity again (a
SuperNode restarted with another ``client-id`` keeps its node id under SuperNode authentication).

Nodes are identified by a ``query`` message; the ``client-id`` a node answers must be a printable string of at
most 128 characters (:func:`common.protocol.client_id_problem`: it keys the ledger and names the client's arrays in
every checkpoint).  A node that does not identify itself is asked again only after a backoff (30 s doubling to
10 min), so a silent or misconfigured node cannot stall every round; malformed identity or evaluate replies are
ignored with a warning and never stop the server.  Every string of a reply that goes into a rejection's reason or a
failure message is cut short (they are logged and rewritten into every checkpoint), and a train reply's
``num-examples``, ``seconds`` and ``epochs`` enter the round's row only as finite numbers in [0, 2^53].
"""

from __future__ import annotations

import math
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TypeVar

import httpx
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectPushError

from common import protocol as P
from common.aggregation import make_aggregator
from common.backoff import GeometricBackoff
from common.config import clients_per_round
from common.errors import PGVIError
from common.factors import PGVIServerState, UpdateRejected, kl_server_step
from common.server_gvi import ServerGVIStep
from common.families import GaussianFactor
from common.metrics import bin_sum_key, ece_from_bin_sums
from common.problem import Problem
from common.protocol import client_id_problem, short_repr as _short
from strategies.checkpoint import (RESUME_TEMP_MIN_AGE_S, load_checkpoint, remove_stale_temp_checkpoints,
                                   save_checkpoint)
from strategies.codec import arrays_to_record, factor_to_record, layout_key, record_to_factor

ServerEvaluate = Callable[[GaussianFactor], dict[str, float]]
T = TypeVar("T")
_RETRY_BACKOFF_MAX = 5.0  # seconds between two attempts of a failing Runtime API call, at most
_QUERY_TIMEOUT_MAX = 60.0  # seconds a mid-run identity query may block the schedule
POLL_FACTOR = 1.5  # growth of the wait between two pulls for replies while none arrives (up to poll_max)
_REQUERY_FIRST, _REQUERY_MAX = 30.0, 600.0  # backoff before asking an unidentified node again (doubles)
RESEND_FIRST, RESEND_MAX = 1.0, 30.0  # asynchronous: wait before re-sending to a node whose message failed
RESEND_FACTOR = 2.0  # growth of that wait per further failure (up to resend_max)
STALE_STREAK_WARN = 3  # asynchronous: warn when this many updates of one client in a row were rejected as stale


def _sleep_until(seconds: float, until: float) -> None:
    """Sleep ``seconds``, but not past the wall-clock time ``until``."""
    time.sleep(min(seconds, max(0.0, until - time.time())))


def _is_transient(err: BaseException) -> bool:
    """A Runtime API error worth retrying: HTTP 5xx/408/429, a lost connection, an expired object session."""
    if isinstance(err, httpx.HTTPStatusError):
        code = err.response.status_code
        return code >= 500 or code in (408, 429)
    return isinstance(err, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError,
                            ObjectPushError, ObjectPullError))


def _last_line(text: str | None, limit: int = 300) -> str:
    """The informative end of a remote traceback (``ValueError: ...``), bounded in length."""
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:limit]


def _strict_int(value: object, key: str) -> int:
    if type(value) is not int:
        raise PGVIError(f"'{key}' must be an integer, got {_short(value)}")  # a peer's value: cut short
    return value


#: The longest text of a reply the server keeps (a failed client's ``reason``: the client cuts its own to this).
MAX_REPLY_TEXT = 500


def _reply_text(value: object, limit: int = MAX_REPLY_TEXT) -> str:
    """A reply's free text (a failed client's ``reason``, an exception raised on a malformed reply) as it goes
    into logs, rejections, ``AllClientsFailed`` and every later checkpoint: a string cut to ``limit`` characters
    (the cut said) with its non-printable characters escaped (``\\n``), anything else named by its type, never its
    whole ``str()`` (a 2 MB string or an Array's repr made every checkpoint megabytes larger)."""
    if not isinstance(value, str):
        return f"<a {type(value).__name__}, not a string>"
    text = value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters, cut)"
    # a newline or an escape sequence would forge a log line (as client_id_problem says of client ids): escaped
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: Train-reply metrics the server records in the round's row, each a finite real number in [0, 2^53]
#: (``num-examples`` an integer too).  2^53: the largest count a float holds exactly, and far from overflowing
#: when the row sums or averages them over any number of clients (1e308 from one client made the row infinite).
TRAIN_ROW_METRICS = ("num-examples", "seconds", "epochs", "start-narrowed", "best-epoch", "polished",
                     "domain-cuts")
_TRAIN_METRIC_MAX = 2.0**53


def _train_metric_problem(key: str, value: object) -> str | None:
    """Why a train reply's metric ``key`` (one of :data:`TRAIN_ROW_METRICS`) cannot go into the round's row."""
    x = _finite_number(value)
    if x is None:
        return "not a finite real number"
    if not 0.0 <= x <= _TRAIN_METRIC_MAX:
        return f"{x:g} is outside [0, 2^53]"
    if key == "num-examples" and not x.is_integer():
        return f"{x:g} is not a whole number"
    return None


def _finite_number(value: object) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool, list or string), else ``None``."""
    x = _metric_number(value)
    return x if x is not None and math.isfinite(x) else None


class AllClientsFailed(RuntimeError):
    """The latest message of every usable client failed, with no update applied since (with full participation:
    every message of a round failed): the run cannot make progress, so it stops with the clients' reason."""


@dataclass
class Reply:
    """A decoded, not yet applied train reply."""

    node_id: int
    client_id: str
    delta: GaussianFactor
    base_version: int
    sent_version: int
    metrics: dict[str, float]
    reply_bytes: int
    #: a second reply of the client in the same batch was rejected: the client may have staged that one's Delta
    #: (a re-executed message), so even once this one is applied the client must be sent its ledger site
    duplicated: bool = False
    #: the reply's update tag ("" from a client without tags)
    tag: str = ""


#: The phases of a round whose wall time the server records (row key ``server-seconds-<phase>``):
#: ``push`` sending train messages to the SuperLink; ``wait`` from the push until the replies are in (the
#: clients' work, the transport of their replies, pulling them); ``apply`` decoding, checking and applying the
#: Deltas (with the checkpoint written before any client learns of them); ``evaluate`` the server-side test
#: evaluation; ``client-evaluate`` the evaluate messages' round trip.  ``round-seconds`` is the whole round, from
#: the start of its first phase (for the asynchronous schedule: the close of the previous round) to its record
#: (with a pipelined evaluation, ``pipeline-evaluation``: to the end of that evaluation); ``started-at`` and
#: ``recorded-at`` are the Unix times of that start and of the record.
SERVER_PHASES = ("push", "wait", "apply", "evaluate", "client-evaluate")


@dataclass
class RoundStats:
    sent: int = 0
    replied: int = 0
    applied: int = 0
    rejected: int = 0
    failed: int = 0
    resync: int = 0
    staleness: list[int] = field(default_factory=list)
    reply_bytes: int = 0
    client_seconds: list[float] = field(default_factory=list)
    client_epochs: list[float] = field(default_factory=list)
    starts_narrowed: int = 0  # applied updates whose local optimiser started narrowed (common.client_update)
    at_start: int = 0  # applied updates whose local optimiser returned its start (no epoch or polish improved on it)
    domain_cut: int = 0  # applied updates with local steps cut short at the divergence's domain (common.domain_guard)
    batch_halvings: int = 0  # the applied batch's damping was halved this many times (it failed jointly before)
    num_examples: float = 0.0
    #: wall seconds the server spent in each phase of the round (see :data:`SERVER_PHASES`)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)  # the same instant, Unix time
    evaluated: float | None = None  # perf_counter when a pipelined server evaluation of the round ended

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` block to ``phase`` (one of :data:`SERVER_PHASES`)."""
        assert phase in SERVER_PHASES, phase
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - t0

    def as_metrics(self) -> dict[str, float]:
        out = {
            "sent": self.sent,
            "replied": self.replied,
            "applied": self.applied,
            "rejected": self.rejected,
            "failed": self.failed,
            "resync": self.resync,
            "reply-bytes": self.reply_bytes,
            "num-examples": self.num_examples,
        }
        if self.staleness:
            out["staleness-mean"] = sum(self.staleness) / len(self.staleness)
            out["staleness-max"] = max(self.staleness)
        if self.client_seconds:
            out["client-seconds-max"] = max(self.client_seconds)
            out["client-seconds-mean"] = sum(self.client_seconds) / len(self.client_seconds)
        if self.client_epochs:  # local optimiser epochs actually run (early stopping), 0 for closed forms
            out["client-epochs-max"] = max(self.client_epochs)
            out["client-epochs-mean"] = sum(self.client_epochs) / len(self.client_epochs)
        if self.starts_narrowed:  # the local divergence was undefined at the configured start of these updates
            out["starts-narrowed"] = self.starts_narrowed
        if self.at_start:  # the local optimiser returned the state it started from
            out["updates-at-start"] = self.at_start
        if self.domain_cut:  # the local optimiser's steps were cut short at the local divergence's domain
            out["updates-domain-cut"] = self.domain_cut
        if self.batch_halvings:  # the batch failed jointly and was applied with its damping halved this many times
            out["batch-halvings"] = self.batch_halvings
        for phase in SERVER_PHASES:
            if phase in self.phase_seconds:
                out[f"server-seconds-{phase}"] = self.phase_seconds[phase]
        return {k: float(v) for k, v in out.items()}


_BIN_PREFIX = "ece-bin-"
#: the values an evaluate reply's bounded metrics can take; one outside is left out of the pooled value
_EVAL_METRIC_RANGE = {"accuracy": (0.0, 1.0), "ece": (0.0, 1.0), "brier": (0.0, 2.0), "rmse": (0.0, math.inf)}
_BIN_KEY = re.compile(r"ece-bin-([0-9]{2})-(count|conf|correct)")  # common.metrics.bin_sum_key, <= 100 bins


def _bin_sums_consistent(bin_values: dict[str, float | None], n: float) -> bool:
    """One reply's ECE bin sums: well-formed keys, all three sums of every bin it names, finite, with
    ``0 <= conf, correct <= count`` and the counts adding up to the reply's ``num-examples``."""
    per_bin: dict[str, dict[str, float]] = {}
    for k, v in bin_values.items():
        m = _BIN_KEY.fullmatch(k)
        if m is None or v is None or not (v >= 0 and math.isfinite(v)):
            return False
        per_bin.setdefault(m.group(1), {})[m.group(2)] = v
    if not per_bin:
        return True
    tol = 1e-6 * max(1.0, n)
    for sums in per_bin.values():
        if len(sums) != 3 or sums["conf"] > sums["count"] + tol or sums["correct"] > sums["count"] + tol:
            return False
    return abs(sum(b["count"] for b in per_bin.values()) - n) <= tol


def _metric_number(value: object) -> float | None:
    """A client metric as a float: a real number including +-inf (an infinite NLL is a measurement: the pooled
    NLL of all points is then infinite too), ``None`` for NaN or anything that is not a real number.  The pooled
    value of a metric some client reported as +inf and another as -inf is undefined: see
    :func:`_pool_client_metrics`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond float's range (10**400): Flower's wire refuses it, the in-process grid not
        return math.inf if value > 0 else -math.inf
    return None if math.isnan(x) else x


def _power_mean(pairs: list[tuple[float, float]], power: int) -> float:
    """``(sum n t^power / sum n)^(1/power)`` over ``(n, t)`` pairs (``n > 0``), as ``max|t| * (sum (n / N)(t /
    max|t|)^power)^(1/power)``: without overflowing where the mean itself does not (``n t`` alone overflowed at
    ``t ~ 1e306``, 1e308 beside -1e308 pooled to inf - inf = NaN, and squaring a finite RMSE of 1e200 gave inf).
    Infinite terms give the infinity of their sign (the caller treats both signs at once as undefined)."""
    infinite = [t for _, t in pairs if math.isinf(t)]
    if infinite:
        return infinite[0]
    scale = max(abs(t) for _, t in pairs)
    if scale == 0.0:
        return 0.0
    total = math.fsum(n for n, _ in pairs)
    mean = math.fsum((n / total) * (t / scale) ** power for n, t in pairs)
    return scale * (mean if power == 1 else math.sqrt(mean) if power == 2 else mean ** (1.0 / power))


def _weighted_mean(pairs: list[tuple[float, float]]) -> float:
    """``sum n t / sum n``: :func:`_power_mean` of power 1."""
    return _power_mean(pairs, 1)


def _root_mean_square(pairs: list[tuple[float, float]]) -> float:
    """``sqrt(sum n r^2 / sum n)`` over per-client RMSEs ``r``, the RMSE of the union: :func:`_power_mean` of
    power 2."""
    return _power_mean(pairs, 2)


def _pool_client_metrics(means: dict[str, float], n_total: float, bins: dict[str, float], all_binned: bool,
                         undefined: frozenset[str] = frozenset()) -> dict[str, float]:
    """Metrics of all clients' test points together: means over points are example-weighted means over the
    clients that reported that metric (``means[k]``, :func:`_weighted_mean` of their examples and values; a client
    without the key, e.g. a regression client beside classifiers, or with a NaN, adds neither to the sum nor to
    the weight); the RMSE is the root of the
    pooled mean square (:func:`_root_mean_square`, in ``means``); the ECE comes from the summed per-bin sums when every client sent them (the
    example-weighted mean of per-client ECEs is not the ECE of the union), else it is that mean.  Counts
    (``num_points`` of common.metrics) are not means: weighted by n they gave sum(n^2)/sum(n); the pooled count is
    ``client-num-examples`` (the examples of every reply taken).

    An infinite client value makes the pooled mean infinite of its sign (+inf with +inf stays +inf); a metric in
    ``undefined`` (one client sent +inf, another -inf: inf - inf has no value) is NaN, written ``nan`` in
    ``metrics.csv`` and the log and ``null`` in ``metrics.jsonl`` (the caller warns, naming the key and the
    nodes).  NaN rather than leaving the key out: a missing key reads as "no client reported it"."""
    out = {f"client-{k}": math.nan if k in undefined else v
           for k, v in means.items() if k not in ("num_points", "num-points")}
    if "ece" in means and all_binned and bins:
        n_bins = 1 + max(int(m.group(1)) for m in map(_BIN_KEY.fullmatch, bins) if m)
        sums = [[bins.get(bin_sum_key(b, what), 0.0) for b in range(n_bins)] for what in ("count", "conf", "correct")]
        try:
            out["client-ece"] = ece_from_bin_sums(*sums)
        except ValueError as err:  # inconsistent bins: keep the weighted mean
            log(WARNING, "client ECE bins not pooled: %s", err)
    out["client-num-examples"] = n_total
    return out


class PGVIStrategy(Strategy):
    """PGVI / FedGVI server.  ``start(grid)`` runs the configured schedule and returns a Flower ``Result``."""

    def __init__(
        self,
        problem: Problem,
        *,
        server_evaluate: ServerEvaluate | None = None,
        on_round_end: Callable[[int, dict[str, float]], None] | None = None,
        poll_interval: float = 0.1,
        poll_max: float = 1.0,
        checkpoint_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
        retry_backoff: float = 0.5,
        resend_first: float = RESEND_FIRST,
        resend_max: float = RESEND_MAX,
    ) -> None:
        self.problem = problem
        self.cfg = problem.cfg
        self.state = PGVIServerState(prior=problem.prior, server_step=problem.server_step)
        self.ledger_versions: dict[str, int] = {}  # client id -> number of Deltas applied to its site
        # client id -> the update tag of the reply whose Delta made its site ("" / absent: unknown, see common.protocol)
        self.ledger_tags: dict[str, str] = {}
        self.node_client: dict[int, str] = {}  # node id -> stable client id
        self.resync: set[str] = set()  # clients that must be sent their ledger site
        self.rejections: list[dict[str, object]] = []
        self.server_evaluate = server_evaluate
        self.on_round_end = on_round_end
        # waiting for replies: polls back off from poll_interval to poll_max (x POLL_FACTOR) until one arrives
        GeometricBackoff(poll_interval, poll_max, POLL_FACTOR)  # a bad pair fails here, not in round 1
        self.poll_interval, self.poll_max = poll_interval, poll_max
        self.retry_backoff = retry_backoff  # first wait after a transient Runtime API error (doubles per retry)
        # asynchronous: a node whose message failed is sent its next one after resend_first seconds, doubling with
        # each further failure up to resend_max; any other outcome (a reply, even a rejected one) resets it
        self.resend_first, self.resend_max = resend_first, resend_max
        self._resend_backoff()  # a bad pair fails here, not in round 1
        self.rng = random.Random(self.cfg.seed)
        self.rho = self.cfg.rho()
        self._posterior_record: tuple[int, ArrayRecord, str] | None = None  # (version, wire record, its layout)
        self.history: list[dict[str, float]] = []
        self._last_failure = ""
        self.aggregator = make_aggregator(self.cfg.aggregator, **self.cfg.aggregator_hyper())
        self.bad_replies: dict[str, int] = {}  # client id -> invalid replies so far (exclusion)
        self.round_completed = 0  # last round recorded and checkpointed with its row (resume point)
        # last round whose train replies were all processed (>= round_completed): synchronous, it is one ahead
        # between the checkpoint of the round's applied batch and the round's record; a resume does not resend it
        self.round_applied = 0
        self.done_in_round: set[str] = set()  # sequential: clients already visited in the current round
        # asynchronous, the open round (round_completed + 1): outcomes resolved so far, and per client the messages
        # sent to it (its next one's round-message); checkpointed, so a resumed run neither runs a full round again
        # nor repeats a client's local seed within the round
        self.async_resolved = 0
        self.async_messages: dict[str, int] = {}
        self._rng_round: tuple[int, object] | None = None  # (round, sampling RNG state before it sampled)
        self._failing: set[str] = set()  # clients whose latest outcome failed, nothing applied since
        # asynchronous: client -> (stale rejections since its last applied update, the largest staleness among them)
        self._stale_streak: dict[str, tuple[int, int]] = {}
        self._requery: dict[int, tuple[float, float]] = {}  # unidentified node -> (next query time, backoff)
        self._order_warned = False
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.resume_from = Path(resume_from) if resume_from else None

    # =============================================================================================
    # Flower Strategy interface (one synchronous round)
    def summary(self) -> None:
        c = self.cfg
        log(INFO, "\t├── PGVI: model %s, family %s, %d parameters", c.model, c.family, self.problem.model.num_params)
        log(INFO, "\t├── client objective: loss %s + divergence %s; server divergence %s", c.loss, c.divergence, c.server_divergence)
        log(INFO, "\t├── schedule %s, damping rho = %.4g, fraction %.2f, min clients %d", c.schedule, self.rho, c.fraction_train, c.min_clients)
        log(INFO, "\t└── local: %d epochs, lr %.3g/%.3g, %d MC samples, batch %s", c.local_epochs, c.lr, c.lr_scale, c.mc_samples, c.batch_size or "full")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        nodes = self._sample_nodes(grid)
        return [self._train_message(n, server_round) for n in nodes]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        stats = RoundStats()
        decoded = self._decode_replies(server_round, replies, stats)
        self._apply_batch(server_round, decoded, stats)
        return self._current_record(), MetricRecord(stats.as_metrics())

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        if not self.cfg.evaluate_clients:
            return []
        record, layout = self._wire_posterior()
        content = RecordDict({P.POSTERIOR: record, P.CONFIG: ConfigRecord({"server-round": server_round,
                                                                           layout_key(P.POSTERIOR): layout})})
        return [Message(content=content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in self._known_nodes(grid)]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        terms: dict[str, list[tuple[float, float]]] = {}  # metric -> (num-examples, value) of the replies with it
        bins: dict[str, float] = {}  # sum over replies of the ECE's per-bin sums
        all_binned = True  # every reply with an ECE also sent its bin sums
        infinite: dict[str, tuple[list[int], list[int]]] = {}  # metric -> nodes whose term was +inf, -inf
        n_total = 0.0
        for msg in replies:
            if msg.has_error() or P.METRICS not in msg.content:
                continue
            try:  # a malformed reply is skipped, never allowed to crash the server
                m = dict(msg.content[P.METRICS])
                count = m.get("num-examples", 0.0)
                values = {k: _metric_number(v) for k, v in m.items() if k != "num-examples"}
                why = _train_metric_problem("num-examples", count)  # a whole number in [0, 2^53], as a train reply's
            except Exception as err:  # e.g. an int too large for a float (10**400: a MetricRecord takes it)
                log(WARNING, "round %d: evaluate reply from node %d skipped: %s", server_round,
                    msg.metadata.src_node_id, f"{type(err).__name__}: {err}")
                continue
            if why is not None or float(count) == 0.0:  # (1e308 twice overflowed the pooling's sum of counts)
                if why is not None:
                    log(WARNING, "round %d: evaluate reply from node %d skipped: 'num-examples' %s", server_round,
                        msg.metadata.src_node_id, why)
                continue
            n = float(count)
            bin_values = {k: v for k, v in values.items() if k.startswith(_BIN_PREFIX)}
            if not _bin_sums_consistent(bin_values, n):
                log(WARNING, "round %d: evaluate reply from node %d skipped: malformed or inconsistent ECE bin "
                    "sums", server_round, msg.metadata.src_node_id)
                continue
            n_total += n
            if "ece" in values and not bin_values:
                all_binned = False
            for k, v in bin_values.items():  # all finite (checked above)
                bins[k] = bins.get(k, 0.0) + v
            dropped = sorted(k for k, v in values.items() if v is None)
            if dropped:
                log(WARNING, "round %d: evaluate reply from node %d: %s not a real number (NaN or not numeric), "
                    "left out of the pooled client metrics", server_round, msg.metadata.src_node_id,
                    ", ".join(repr(k) for k in dropped))
            outside = sorted(k for k, v in values.items() if v is not None and k in _EVAL_METRIC_RANGE
                             and not _EVAL_METRIC_RANGE[k][0] <= v <= _EVAL_METRIC_RANGE[k][1])
            if outside:
                log(WARNING, "round %d: evaluate reply from node %d: %s outside the metric's range, left out of the "
                    "pooled client metrics", server_round, msg.metadata.src_node_id,
                    ", ".join(f"{k!r} = {values[k]:g}" for k in outside))
                values.update(dict.fromkeys(outside))
            for k, v in values.items():
                if v is not None and k not in bin_values:
                    if math.isinf(v):
                        infinite.setdefault(k, ([], []))[v < 0].append(msg.metadata.src_node_id)
                    terms.setdefault(k, []).append((n, v))
        if n_total == 0:
            return None
        undefined = frozenset(k for k, (pos, neg) in infinite.items() if pos and neg)
        means = {k: math.nan if k in undefined else (_root_mean_square(pairs) if k == "rmse" else _weighted_mean(pairs))
                 for k, pairs in terms.items()}
        out = _pool_client_metrics(means, n_total, bins, all_binned, undefined)
        for k in sorted(undefined):
            if math.isnan(out.get(f"client-{k}", 0.0)):  # not a count (not pooled) nor an ECE pooled from its bins
                pos, neg = infinite[k]
                log(WARNING, "round %d: client metric %r is +inf from node(s) %s and -inf from node(s) %s: its pooled "
                    "value is undefined, recorded as NaN (null in metrics.jsonl)", server_round, k,
                    ", ".join(map(str, pos)), ", ".join(map(str, neg)))
        return MetricRecord(out)

    # =============================================================================================
    # running the schedules
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run PGVI.  The initial posterior is the prior (``initial_arrays`` is not used: PGVI starts at pi)."""
        num_rounds = num_rounds or self.cfg.num_server_rounds
        timeout = timeout or self.cfg.round_timeout_s
        log(INFO, "Starting PGVI strategy (%s schedule, %d rounds)", self.cfg.schedule, num_rounds)
        self.summary()
        self._remove_stale_temp_checkpoints()
        if self.resume_from is not None:
            load_checkpoint(self, self.resume_from)
            log(INFO, "resumed from %s after round %d (posterior version %d)", self.resume_from,
                self.round_completed, self.state.version)
            if self.on_round_end is not None:  # this run's records hold every round, the resumed ones included
                for row in self.history:
                    self.on_round_end(int(row["round"]), row)
        self._wait_for_clients(grid)
        result = Result()
        t0 = time.time()
        if self.round_completed == 0 and not self.history:
            self._record_round(0, RoundStats(), grid, result, do_client_eval=False)
        if self.cfg.schedule == "asynchronous":
            if self.cfg.evaluate_clients:
                log(WARNING, "evaluate-clients is not run with the asynchronous schedule (every client always has a "
                    "train message in flight); the server-side test metrics are recorded each round")
            self._run_asynchronous(grid, num_rounds, timeout, result)
        else:
            self._run_rounds(grid, num_rounds, timeout, result)
        result.arrays = self._current_record()
        log(INFO, "PGVI finished in %.2fs: %d updates applied, %d rejected", time.time() - t0,
            sum(self.ledger_versions.values()), len(self.rejections))
        return result

    def _remove_stale_temp_checkpoints(self) -> None:
        """Delete the temp files of checkpoints a killed server was writing (``common.atomic_io`` removes its temp
        file on any error, but a SIGKILL or a power cut leaves it: one checkpoint's size per kill, never read) in
        the directory this run checkpoints to, and those older than ``RESUME_TEMP_MIN_AGE_S`` in the one it resumes
        from (which may be a live run's: its write in progress keeps its temp file)."""
        dirs = {}
        if self.resume_from is not None:
            dirs[Path(self.resume_from).resolve()] = RESUME_TEMP_MIN_AGE_S
        if self.checkpoint_dir is not None:
            dirs[Path(self.checkpoint_dir).resolve()] = 0.0
        for directory, min_age in dirs.items():
            removed, size = remove_stale_temp_checkpoints(directory, min_age)
            if removed:
                log(INFO, "removed %d temp file(s) of an interrupted checkpoint write (%.1f MB) from %s", removed,
                    size / 1e6, directory)

    def pipelines_evaluation(self) -> bool:
        """Whether round r's server evaluation runs while the clients work on round r+1 (run config
        ``pipeline-evaluation``; synchronous schedule, no client-side evaluation, a server evaluation to run)."""
        return (self.cfg.pipeline_evaluation and self.cfg.schedule == "synchronous" and not self.cfg.evaluate_clients
                and self.server_evaluate is not None)

    def _run_rounds(self, grid: Grid, num_rounds: int, timeout: float, result: Result) -> None:
        """The synchronous and sequential schedules.

        Each round ends with its record (server evaluation, row, ``on_round_end``), the checkpoint that holds
        that row, and the progress check.  With :meth:`pipelines_evaluation` the server evaluation of round r
        runs in a background thread from the end of round r's apply, and the rest of round r's ending follows
        the push of round r+1's messages, so the evaluation overlaps the clients' work; the records, the
        checkpoints' contents and every posterior are those of the unpipelined run.  A server crash between that
        push and round r's checkpoint resumes from the checkpoint written when round r's Deltas were applied: round
        r is recorded, not sent again (:meth:`_record_applied_round`), and round r+1 draws the clients it drew
        before the crash (:meth:`sampling_state_to_checkpoint`); clients with a pending update of round r+1
        reconcile through the ledger.
        A round after which the run stops (:meth:`_progress_failure`) is never pipelined: its record is written and
        the run stops before any further message is sent.
        """
        pending: list[Callable[[], None]] = []  # at most one: the ending of the previous round

        def finish_pending() -> None:
            while pending:
                pending.pop()()

        pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgvi-evaluate") if self.pipelines_evaluation()
                else None)
        self._failing = set()
        run_sent = run_failed = 0  # this process's rounds (a resumed run counts afresh)
        try:
            self._record_applied_round(grid, result)
            self._record_open_round_past_the_end(grid, num_rounds, result)
            first_round = self.round_completed + 1
            for rnd in range(first_round, num_rounds + 1):
                self._await_clients(grid, rnd)
                self._rng_round = (rnd, self.rng.getstate())
                stats = RoundStats()
                if self.cfg.schedule == "synchronous":  # ends the previous round once it has pushed (or had nothing to)
                    self._round_synchronous(grid, rnd, timeout, stats, after_push=finish_pending)
                else:  # never pipelined
                    self._round_sequential(grid, rnd, timeout, stats)
                result.train_metrics_clientapp[rnd] = MetricRecord(stats.as_metrics())
                failure = self._progress_failure(rnd, stats, grid)
                run_sent, run_failed = run_sent + stats.sent, run_failed + stats.failed
                if (failure is None and rnd == num_rounds and run_sent and run_failed >= run_sent
                        and self.state.version == 0):
                    # fraction-train < 1: the sampled clients may never have covered every client, so no round
                    # stopped the run; a run whose every message failed still ends as a failure, not "completed".
                    # Nothing applied, by this process or before a restart: the state's version is still 0 (a
                    # resumed run counts its messages afresh; its uninterrupted twin applied the checkpoint's
                    # updates and completed)
                    failure = (f"round {rnd}: no update was applied in rounds {first_round}-{rnd}: all {run_sent} "
                               f"client messages failed (last reason: {self._last_failure})")
                if pool is not None and failure is None:
                    pending.append(self._end_round_later(pool, rnd, stats, grid, result))
                else:
                    self._close_round(rnd, stats, grid, result, do_client_eval=True, failure=failure)
            finish_pending()
        except BaseException:
            try:  # keep the last round's record and checkpoint if its evaluation can still finish
                finish_pending()
            except Exception as err:  # noqa: BLE001 - the original error is the one to report
                log(WARNING, "the pending record of the last round could not be written: %s: %s",
                    type(err).__name__, err)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _record_applied_round(self, grid: Grid, result: Result) -> None:
        """Resumed from a checkpoint written between round r's applied batch and round r's record (a crash during
        its server evaluation or record, or, pipelined, during round r+1's push): round r's Deltas are in the
        ledger, so sending round r again would make every sampled client update once more than in the
        uninterrupted run.  Round r is only evaluated and recorded (once); the run continues with round r+1.  Its
        counters died with the server: like the row of any round interrupted by a crash, its row counts only what
        this run did in it (nothing); ``version`` shows its applied batch."""
        rnd = self.round_applied
        if rnd <= self.round_completed:
            return
        log(INFO, "round %d: its updates were applied before the restart; recording it without sending it again", rnd)
        stats = RoundStats()
        result.train_metrics_clientapp[rnd] = MetricRecord(stats.as_metrics())
        self._close_round(rnd, stats, grid, result, do_client_eval=True)

    def _record_open_round_past_the_end(self, grid: Grid, num_rounds: int, result: Result) -> None:
        """Resumed with fewer ``num-server-rounds`` than the open round, whose applied updates (a sequential round's
        first visits, an asynchronous round's arrivals) are in the state: that round is recorded, as the synchronous
        schedule's applied round is (:meth:`_record_applied_round`), so that the last row describes the posterior
        the run writes."""
        rnd = self.round_completed + 1
        if rnd <= num_rounds or not self.history or self.history[-1]["version"] == self.state.version:
            return
        log(INFO, "round %d: %d update(s) of it were applied before the restart and no round is left to run "
            "(num-server-rounds %d); recording it", rnd, self.state.version - int(self.history[-1]["version"]),
            num_rounds)
        result.train_metrics_clientapp[rnd] = MetricRecord(RoundStats().as_metrics())
        self._close_round(rnd, RoundStats(), grid, result, do_client_eval=self.cfg.schedule != "asynchronous")

    def sampling_state_to_checkpoint(self) -> object:
        """The sampling RNG state a checkpoint written now must hold: the state before the sampling of the first round
        a run resumed from it sends (round ``round_applied + 1``).  That round may be sampled already: with a
        pipelined evaluation round r's checkpoint is written after round r+1's push, and a sequential round writes a
        checkpoint after each update; the resumed run must draw the clients the uninterrupted run drew."""
        if self._rng_round is not None and self._rng_round[0] == self.round_applied + 1:
            return self._rng_round[1]
        return self.rng.getstate()

    def _end_round_later(self, pool: ThreadPoolExecutor, rnd: int, stats: RoundStats, grid: Grid,
                         result: Result) -> Callable[[], None]:
        """Start round ``rnd``'s server evaluation in ``pool``; return the rest of the round's ending."""
        assert self.state.posterior is not None and self.server_evaluate is not None
        evaluate, posterior = self.server_evaluate, self.state.posterior  # the posterior after round rnd

        def run() -> dict[str, float]:
            with stats.timed("evaluate"):
                metrics = evaluate(posterior)
            stats.evaluated = time.perf_counter()
            return metrics

        future: Future[dict[str, float]] = pool.submit(run)
        # the progress check was made when the round ended (a round after which the run stops is not pipelined)
        return lambda: self._close_round(rnd, stats, grid, result, do_client_eval=False, server_metrics=future.result())

    def _close_round(self, rnd: int, stats: RoundStats, grid: Grid, result: Result, do_client_eval: bool,
                     server_metrics: dict[str, float] | None = None, failure: str | None = None) -> None:
        """Record round ``rnd`` (:meth:`_record_round`), then checkpoint it (after the row: the checkpoint of round
        ``rnd`` holds its history row), then stop the run with ``failure`` (:meth:`_progress_failure`) if given."""
        self._record_round(rnd, stats, grid, result, do_client_eval, server_metrics)
        self._end_round(rnd)
        if failure is not None:
            raise AllClientsFailed(failure)

    def _checkpoint(self) -> None:
        if self.checkpoint_dir is not None:
            save_checkpoint(self, self.checkpoint_dir)

    def _end_round(self, rnd: int) -> None:
        self.round_completed = rnd
        self.round_applied = max(self.round_applied, rnd)
        self.done_in_round = set()
        self.async_resolved, self.async_messages = 0, {}
        self._checkpoint()

    def _count_timeouts(self, rnd: int, sent: int, replies: list[Message] | None, stats: RoundStats) -> list[Message]:
        """Count the ``sent`` messages without a reply as failures and return the replies (``None``: nothing could be
        pushed, and :meth:`_runtime` has already named the Runtime API's failure as the last reason)."""
        if replies is None:
            stats.failed += sent
            log(WARNING, "round %d: %d message(s) could not be pushed; those clients keep their old sites", rnd, sent)
            return []
        missing = sent - len({m.metadata.reply_to_message_id for m in replies})  # a duplicate hides no timeout
        if missing > 0:
            stats.failed += missing
            self._last_failure = f"{missing} client(s) did not reply within round-timeout-s"
            log(WARNING, "round %d: %d client(s) did not reply in time; they keep their old sites", rnd, missing)
        return replies

    @staticmethod
    def _all_failed(stats: RoundStats) -> bool:
        return stats.sent > 0 and stats.applied == 0 and stats.failed >= stats.sent

    def _usable_clients(self, grid: Grid) -> set[str]:
        """The ids of the connected, identified, not excluded clients (no identity query is sent)."""
        return {self.node_client[n] for n in self._usable(grid.get_node_ids())}

    def _progress_failure(self, rnd: int, stats: RoundStats, grid: Grid) -> str | None:
        """Synchronous and sequential: why the run must stop after round ``rnd`` (:class:`AllClientsFailed`), else
        ``None``.  The asynchronous schedule's rule (:meth:`_check_async_progress`): the latest message of every
        usable client failed and no update was applied since, checked after a round whose every message failed.
        With every client in each round that is "every client of the round failed", as before; with
        ``fraction-train`` < 1 a round whose few sampled clients failed does not stop the run while a client not
        tried since the last applied update may be healthy (a failing client keeps its old site).  If no usable
        client is left, the round's own outcome decides.  (A run whose every message failed without any round
        stopping it, possible when the samples never covered every client, fails after its last round:
        :meth:`_run_rounds`.)"""
        if not self._all_failed(stats):
            return None
        clients = self._usable_clients(grid)
        every_latest = self._every_latest_failed(rnd, clients)
        if clients and every_latest is None:
            return None
        if not clients or stats.sent >= len(clients):  # the round itself tried every client
            return f"round {rnd}: all {stats.sent} client messages failed (last reason: {self._last_failure})"
        return every_latest

    def _note_outcome(self, node: int, failed: bool, applied: bool = False) -> None:
        """Remember whether the latest message to ``node``'s client failed, for :meth:`_check_async_progress` and
        :meth:`_progress_failure`.  An applied update is progress: it forgives every earlier failure."""
        if applied:
            self._failing.clear()
        cid = self.node_client.get(node)
        if cid is None:
            return
        if failed:
            self._failing.add(cid)
        else:  # a reply, even a rejected one or a resync request: the client is working
            self._failing.discard(cid)

    def _check_async_progress(self, rnd: int, clients: set[str]) -> None:
        """Asynchronous: stop when the latest message of every usable client (connected, identified, not excluded)
        failed and no update was applied since.  A round's counts cannot tell: a round is one outcome per usable
        client, so a client that fails at once fills it alone while a slower, healthy client's update is on its way
        (and a failing client keeps its old site; the run goes on)."""
        failure = self._every_latest_failed(rnd, clients)
        if failure is not None:
            raise AllClientsFailed(failure)

    def _every_latest_failed(self, rnd: int, clients: set[str]) -> str | None:
        """Why the run cannot make progress if the latest message of every one of ``clients`` (non-empty) failed
        and no update was applied since (:meth:`_note_outcome`), else ``None``; the rule of
        :meth:`_check_async_progress` and :meth:`_progress_failure`."""
        if not (clients and clients <= self._failing):
            return None
        return (f"round {rnd}: the latest message of every client ({', '.join(sorted(clients))}) failed and no "
                f"update was applied since (last reason: {self._last_failure})")

    def _note_stale(self, rnd: int, client_id: str, staleness: int, bound: int) -> None:
        """Asynchronous: count a stale rejection of ``client_id``'s update; when :data:`STALE_STREAK_WARN` of its
        updates in a row were rejected as stale, none applied in between, warn once for that streak: the client is
        slower than the others (or ``max-staleness`` is below M - 1), so every update it sends arrives after more
        than ``max-staleness`` others and it never contributes."""
        streak, seen = self._stale_streak.get(client_id, (0, 0))
        streak, seen = streak + 1, max(seen, staleness)
        self._stale_streak[client_id] = (streak, seen)
        if streak == STALE_STREAK_WARN:
            log(WARNING, "round %d: client '%s': its last %d updates in a row were rejected as stale (staleness up to "
                "%d > max-staleness %d) and none was applied in between: it contributes nothing to the posterior; a "
                "larger max-staleness (at least %d) would accept such updates", rnd, client_id, streak, seen, bound,
                seen)

    def _note_applied(self, client_id: str) -> None:
        """Asynchronous: an update of ``client_id`` was applied: its stale streak (:meth:`_note_stale`) ends."""
        self._stale_streak.pop(client_id, None)

    def _round_synchronous(self, grid: Grid, rnd: int, timeout: float, stats: RoundStats,
                           after_push: Callable[[], None] | None = None) -> None:
        msgs = list(self.configure_train(rnd, self._current_record(), ConfigRecord(), grid))
        stats.sent += len(msgs)
        replies = self._count_timeouts(rnd, len(msgs), self._send_and_receive(grid, msgs, timeout, stats, after_push),
                                       stats)
        failed_nodes: set[int] = set()
        applied = stats.applied
        with stats.timed("apply"):
            self._apply_batch(rnd, self._decode_replies(rnd, replies, stats, failed_nodes), stats, whole_round=True)
        answered = {m.metadata.src_node_id for m in replies}
        for m in msgs:  # an error reply, a failed status or no reply (a timeout, a failed push) is a failure
            node = m.metadata.dst_node_id
            self._note_outcome(node, failed=node in failed_nodes or node not in answered)
        if stats.applied > applied:  # the batch is applied after (and forgives) its own failures
            self._failing.clear()

    def _round_sequential(self, grid: Grid, rnd: int, timeout: float, stats: RoundStats) -> None:
        nodes = self._sample_nodes(grid)
        by_client = {self.node_client[n]: n for n in nodes}
        for cid in self._sequential_order(by_client):
            node = by_client.get(cid)
            if node is None or cid in self.done_in_round:
                continue
            stats.sent += 1
            failed, applied = stats.failed, stats.applied
            replies = self._count_timeouts(
                rnd, 1, self._send_and_receive(grid, [self._train_message(node, rnd)], timeout, stats), stats)
            self.done_in_round.add(cid)
            with stats.timed("apply"):
                self._apply_batch(rnd, self._decode_replies(rnd, replies, stats), stats)
            self._note_outcome(node, failed=stats.failed > failed, applied=stats.applied > applied)

    def _sequential_order(self, by_client: dict[str, int]) -> list[str]:
        """``sequential-order``'s clients first, in that order, then every other client in sorted order: a client
        missing from the list is still visited, never silently dropped (warned about once)."""
        listed = [c.strip() for c in self.cfg.sequential_order.split(",") if c.strip()]
        rest = sorted(c for c in by_client if c not in listed)
        if listed and not self._order_warned:
            unknown = sorted(c for c in listed if c not in self.node_client.values())
            if unknown:
                log(WARNING, "sequential-order names client(s) that have not connected: %s", ", ".join(unknown))
            if rest:
                log(WARNING, "sequential-order does not list client(s) %s: they are visited after the listed ones, "
                    "in sorted order", ", ".join(rest))
            self._order_warned = True
        return listed + rest

    def _run_asynchronous(self, grid: Grid, num_rounds: int, timeout: float, result: Result) -> None:
        """Keep one message in flight per client; a 'round' is as many outcomes (applied, rejected or failed) as
        there are usable clients (connected, identified, not excluded) when the round opens, whatever
        fraction-train: num-clients once every client has connected, fewer while some have not (a client that never
        connects must not keep a round from closing), more from the round after a late client was identified.

        A node whose message failed (an error reply, a failed push, a timeout) or whose reply applied nothing for
        another reason than staleness (a resync request, a Delta against another site version, a rejected Delta) is
        sent its next message only after a back-off (``resend_first`` seconds, doubling per further such outcome up
        to ``resend_max``; an applied or a stale update resets it): a client that answers at once would otherwise be
        re-sent at every poll and fill the remaining rounds with its outcomes while a healthy client's update is
        still being computed (a resync flood closed every round with nothing applied, and the run 'completed').

        A message times out when a pull made more than ``round-timeout-s`` after its push finds no reply to it (a
        reply that arrived while the server was closing a round is pulled first). The run as a whole waits for its
        clients at most ``round-timeout-s`` x ``num-server-rounds`` (the server's own work, closing rounds and
        waiting for clients to connect, is not counted): at that deadline it ends with a warning, as a run with fewer
        rounds completed than planned (``rounds-completed`` in the summary), not as a failure."""
        self._record_open_round_past_the_end(grid, num_rounds, result)
        per_round = max(1, len(self._known_nodes(grid)))  # outcomes that close the round: one per usable client
        inflight: dict[str, tuple[int, float, int]] = {}  # message id -> (node id, sent time, posterior version)
        busy: set[int] = set()
        resend_at: dict[int, tuple[float, GeometricBackoff]] = {}  # failing node -> (earliest next send, its back-off)
        rnd, stats = self.round_completed + 1, RoundStats()
        deadline = time.time() + timeout * num_rounds

        poll = self._reply_poll()
        usable: list[int] = []  # the nodes the last dispatch could use (connected, identified, not excluded)
        self._failing = set()
        self._stale_streak = {}

        def outcome(node: int, failed: bool, applied: bool = False, wait: bool = False) -> None:
            self._note_outcome(node, failed, applied)
            if not applied:  # an applied update was checkpointed with it; a failure or rejection counts in the round
                self._checkpoint()  # too, so a resumed run does not wait for one outcome more than the round had
            if not (failed or wait):
                resend_at.pop(node, None)
                return
            backoff = resend_at[node][1] if node in resend_at else self._resend_backoff()
            resend_at[node] = (time.time() + backoff.next_wait(), backoff)

        def close_if_full(rnd: int, stats: RoundStats) -> tuple[int, RoundStats]:
            nonlocal per_round, deadline
            if rnd > num_rounds or self.async_resolved < per_round:
                return rnd, stats
            started = time.time()
            result.train_metrics_clientapp[rnd] = MetricRecord(stats.as_metrics())
            self._close_round(rnd, stats, grid, result, do_client_eval=False)
            self._check_async_progress(rnd, {self.node_client[n] for n in usable if n in self.node_client})
            if rnd < num_rounds:  # the next round opens: its size is the number of usable clients now
                per_round = max(1, len(self._known_nodes(grid)))
            deadline += time.time() - started  # the server's own work (evaluation, record, checkpoint, queries)
            return rnd + 1, RoundStats()

        # resumed from a checkpoint of a full round not yet recorded (a crash while it was being closed): record it
        rnd, stats = close_if_full(rnd, stats)
        while rnd <= num_rounds:
            if time.time() > deadline:
                log(WARNING, "asynchronous schedule: overall deadline (round-timeout-s x num-server-rounds = %gs of "
                    "waiting for clients) reached in round %d of %d: the run ends early", timeout * num_rounds, rnd,
                    num_rounds)
                break
            if not inflight:
                started = time.time()
                self._await_clients(grid, rnd)
                deadline += time.time() - started
            usable = self._sample_nodes(grid, fraction=1.0)
            now = time.time()
            free = [n for n in usable if n not in busy and resend_at.get(n, (0.0,))[0] <= now]
            if free:
                msgs = [self._train_message(n, rnd, self.async_messages.get(self.node_client[n], 0)) for n in free]
                for n in free:
                    cid = self.node_client[n]
                    self.async_messages[cid] = self.async_messages.get(cid, 0) + 1
                with stats.timed("push"):
                    mids = self._runtime("push-messages", lambda: list(grid.push_messages(msgs)),
                                         min(deadline, time.time() + timeout))
                if mids is None:
                    log(WARNING, "round %d: %d message(s) could not be pushed; those clients keep their old sites", rnd, len(msgs))
                    for msg in msgs:  # one outcome at a time: a round closes after exactly per_round outcomes
                        stats.sent += 1
                        stats.failed += 1
                        self.async_resolved += 1
                        outcome(msg.metadata.dst_node_id, failed=True)
                        rnd, stats = close_if_full(rnd, stats)
                else:
                    for mid, msg in zip(mids, msgs):
                        inflight[mid] = (msg.metadata.dst_node_id, time.time(), self.state.version)
                        busy.add(msg.metadata.dst_node_id)
                    stats.sent += len(msgs)
            if free:
                poll.reset()
            replies = []
            pulled_at = time.time()  # a message times out only if a pull this long after its push found no reply
            if inflight:
                with stats.timed("wait"):
                    replies = self._runtime("pull-messages", lambda: list(grid.pull_messages(list(inflight))),
                                            min(deadline, time.time() + timeout)) or []
                self._attribute(replies, {mid: v[0] for mid, v in inflight.items()})
            for reply in replies:
                node, _, sent_version = inflight.pop(reply.metadata.reply_to_message_id,
                                                     (reply.metadata.src_node_id, 0.0, -1))
                busy.discard(node)
                self.async_resolved += sent_version >= 0  # a duplicate or unsolicited reply resolves no message
                if rnd > num_rounds:  # the last round closed earlier in this batch
                    for d in self._decode_replies(rnd, [reply], RoundStats(), charge=False):
                        self._reject(rnd, d.client_id, d.node_id, "arrived after the last round", None, bad=False)
                    continue
                failed, applied, stale = stats.failed, stats.applied, False
                for d in self._decode_replies(rnd, [reply], stats, charge=sent_version >= 0):
                    if sent_version < 0:  # not a reply to a message in flight
                        self._reject(rnd, d.client_id, d.node_id, "reply to no message in flight", stats, bad=False)
                        continue
                    staleness = self.state.version - sent_version  # the server's record, not the reply's claim
                    stats.staleness.append(staleness)
                    bound = self.cfg.staleness_bound()
                    if staleness > bound:
                        self._reject(rnd, d.client_id, d.node_id, f"stale update ({staleness} versions > max-staleness {bound})", stats, bad=False)
                        self._note_stale(rnd, d.client_id, staleness, bound)
                        stale = True
                        continue
                    before = stats.applied
                    with stats.timed("apply"):
                        self._apply_batch(rnd, [d], stats)
                    if stats.applied > before:
                        self._note_applied(d.client_id)
                if sent_version >= 0:  # the outcome of a message in flight (not a duplicate)
                    # every outcome but an applied update or a stale one (other clients' updates landed meanwhile:
                    # progress) waits before its next message, as a failure does: a resync, a Delta against another
                    # site version or a rejected one cost the client nothing and would otherwise fill the rounds
                    # while a healthy client computes
                    applied_now = stats.applied > applied
                    outcome(node, failed=stats.failed > failed, applied=applied_now, wait=not (applied_now or stale))
                rnd, stats = close_if_full(rnd, stats)  # a round is exactly per_round messages, not a whole pull
            for mid, (node, sent, _) in list(inflight.items()):
                if pulled_at - sent > timeout:
                    inflight.pop(mid)
                    busy.discard(node)
                    stats.failed += 1
                    self.async_resolved += 1
                    self._last_failure = (f"client '{self.node_client.get(node, node)}' did not reply within "
                                          "round-timeout-s")
                    outcome(node, failed=True)
                    log(WARNING, "client on node %d timed out after %.3gs; it keeps its old site", node, timeout)
                    rnd, stats = close_if_full(rnd, stats)
            if replies:
                poll.reset()
            else:
                # wake for the run's deadline, the next in-flight message's timeout and the next resend to a failing
                # node, whatever the back-off
                wake = min([deadline] + [sent + timeout for _, sent, _ in inflight.values()]
                           + [at for n, (at, _) in resend_at.items() if n in usable and n not in busy])
                with stats.timed("wait"):
                    _sleep_until(poll.next_wait(), wake)
        # let in-flight replies arrive so that no client is left with an unresolved pending update
        if inflight:
            late = self._collect(grid, {mid: v[0] for mid, v in inflight.items()}, min(timeout, 5.0))
            for reply in late:
                for d in self._decode_replies(rnd, [reply], RoundStats(), charge=False):
                    self._reject(rnd, d.client_id, d.node_id, "arrived after the last round", None, bad=False)

    # =============================================================================================
    # nodes and messages
    def _wait_for_clients(self, grid: Grid) -> None:
        """Block until ``min-clients`` nodes are connected *and* have told us their client id."""
        deadline = time.time() + self.cfg.wait_for_clients_s
        while True:
            nodes = list(grid.get_node_ids())
            self._discover(grid, nodes, timeout=max(1.0, min(self.cfg.round_timeout_s, deadline - time.time())),
                           force=True)
            known = [n for n in nodes if n in self.node_client]
            if len(known) >= self.cfg.min_clients:
                break
            if time.time() > deadline:
                raise RuntimeError(
                    f"only {len(known)} of min-clients={self.cfg.min_clients} clients connected and identified "
                    f"within wait-for-clients-s={self.cfg.wait_for_clients_s:g}s ({len(nodes)} nodes connected"
                    + (f"; last client error: {self._last_failure})" if self._last_failure else ")")
                )
            time.sleep(1.0)
        ids = sorted(self.node_client.values())
        shown = ", ".join(ids) if len(ids) <= 12 else ", ".join(ids[:5]) + ", ..., " + ", ".join(ids[-2:])
        log(INFO, "%d clients connected: %s", len(ids), shown)

    def _discover(self, grid: Grid, nodes: list[int], timeout: float | None = None, force: bool = False) -> None:
        """Learn the stable client id (and site version) of nodes not seen before via ``query`` messages.

        During the run (``force=False``) a node that did not identify itself (its query failed, timed out or
        was malformed) is asked again only after a backoff (30 s, doubling to 10 min), and a query blocks the
        schedule for at most ``min(round-timeout-s, 60 s)``: a silent or misconfigured node must not stall
        every round.
        """
        now = time.time()
        connected = set(nodes)
        unknown = [n for n in nodes if n not in self.node_client and (force or self._requery.get(n, (0.0,))[0] <= now)]
        if not unknown:
            return
        if timeout is None:
            timeout = min(self.cfg.round_timeout_s, _QUERY_TIMEOUT_MAX)
        msgs = [
            Message(content=RecordDict({P.CONFIG: ConfigRecord({"request": "identity"})}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in unknown
        ]
        for reply in self._send_and_receive(grid, msgs, timeout) or []:
            if reply.has_error():  # e.g. the node's config is refused (client/node_request.py): say so, once a query
                self._last_failure = _last_line(reply.error.reason)
                log(WARNING, "identity query to node %d failed (asked again after a backoff): %s",
                    reply.metadata.src_node_id, self._last_failure)
                continue
            try:  # a malformed identity reply is ignored (the node is asked again later), never a crash
                cfg = reply.content[P.CONFIG]
                cid = cfg.get("client-id", "")
                client_version = cfg.get("site-version", 0)
            except Exception as err:
                log(WARNING, "identity reply from node %d ignored: %s: %s", reply.metadata.src_node_id,
                    type(err).__name__, _reply_text(str(err), 300))
                continue
            if not isinstance(cid, str) or not cid:
                log(WARNING, "identity reply from node %d ignored: no client-id string", reply.metadata.src_node_id)
                continue
            node = reply.metadata.src_node_id
            why = client_id_problem(cid)  # it keys the ledger and names the node's arrays in every checkpoint
            if why is not None:
                self._last_failure = f"node {node}: client-id {why}"
                log(WARNING, "identity reply from node %d ignored: client-id %s (check the node's client-id "
                    "setting)", node, why)
                continue
            holder = next((n for n, c in self.node_client.items() if c == cid and n != node), None)
            if holder is not None and holder in connected:  # two live nodes cannot share one ledger entry
                log(WARNING, "node %d claims client id '%s', which connected node %d holds: ignored (check the "
                    "nodes' client-id settings)", node, cid, holder)
                continue
            if cid not in self.ledger_versions and len(self.ledger_versions) >= self.cfg.num_clients:
                # num-clients is the number of partitions: an (M+1)-th id is a node renamed or misconfigured, whose
                # data a ledger entry already holds (a resume with other ids counted every point twice)
                self._last_failure = (f"node {node}: client id {_short(cid)} would be client "
                                      f"{len(self.ledger_versions) + 1} of num-clients={self.cfg.num_clients}")
                log(WARNING, "identity reply from node %d ignored: client id %s is not in the ledger, which already "
                    "holds num-clients=%d clients (%s): a node that changed its client-id would count its data "
                    "twice (check the nodes' client-id settings, or num-clients)", node, _short(cid),
                    self.cfg.num_clients, ", ".join(_short(c) for c in sorted(self.ledger_versions)[:5])
                    + (", ..." if len(self.ledger_versions) > 5 else ""))
                continue
            if holder is not None:  # the old node is gone: a restarted client (new node id) takes its site over
                log(INFO, "client '%s' moved from node %d to node %d", cid, holder, node)
                del self.node_client[holder]
            self.node_client[node] = cid
            self._requery.pop(node, None)
            self.ledger_versions.setdefault(cid, 0)
            self.state.site(cid)
            if type(client_version) is not int or client_version != self.ledger_versions[cid]:
                self.resync.add(cid)  # a version we cannot read counts as a mismatch: the client gets its site
        now = time.time()
        for n in unknown:
            if n not in self.node_client:
                backoff = self._requery.get(n, (0.0, _REQUERY_FIRST / 2))[1]
                backoff = min(2 * backoff, _REQUERY_MAX)
                self._requery[n] = (now + backoff, backoff)

    def _excluded(self, client_id: str) -> bool:
        limit = self.cfg.max_bad_replies
        return bool(limit) and self.bad_replies.get(client_id, 0) >= limit

    def _await_clients(self, grid: Grid, rnd: int) -> None:
        """Before a round (or, asynchronously, when nothing is in flight): if no usable client is connected, wait
        up to ``wait-for-clients-s`` for one; then stop with :class:`AllClientsFailed` rather than run empty
        rounds and report the run as completed."""
        deadline = time.time() + self.cfg.wait_for_clients_s
        while not self._known_nodes(grid):
            self._check_not_all_excluded()
            if time.time() >= deadline:
                raise AllClientsFailed(f"round {rnd}: no client is connected (waited wait-for-clients-s="
                                       f"{self.cfg.wait_for_clients_s:g}s)")
            log(WARNING, "round %d: no client is connected; waiting for one", rnd)
            _sleep_until(1.0, deadline)

    def _check_not_all_excluded(self) -> None:
        if self.node_client and all(self._excluded(c) for c in self.node_client.values()):
            raise AllClientsFailed(f"every client is excluded (max-bad-replies={self.cfg.max_bad_replies}): "
                                   f"{', '.join(sorted(set(self.node_client.values())))}")

    def _known_nodes(self, grid: Grid) -> list[int]:
        nodes = list(grid.get_node_ids())
        self._discover(grid, nodes)
        return sorted(self._usable(nodes), key=lambda n: self.node_client[n])

    def _usable(self, nodes: Iterable[int]) -> list[int]:
        """Of ``nodes``, the identified ones whose client is not excluded."""
        return [n for n in nodes if n in self.node_client and not self._excluded(self.node_client[n])]

    def _sample_nodes(self, grid: Grid, fraction: float | None = None) -> list[int]:
        nodes = self._known_nodes(grid)
        if not nodes:
            self._check_not_all_excluded()
        frac = self.cfg.fraction_train if fraction is None else fraction
        k = clients_per_round(frac, len(nodes))  # halves up; min-clients gates the start of the run, not each round
        if k >= len(nodes):
            return nodes
        return sorted(self.rng.sample(nodes, k), key=lambda n: self.node_client[n])

    def _current_record(self) -> ArrayRecord:
        """The posterior's natural parameters, one Array per tensor (the Strategy API's model record)."""
        assert self.state.posterior is not None
        return arrays_to_record(self.state.posterior.to_numpy())

    def _wire_posterior(self) -> tuple[ArrayRecord, str]:
        """The posterior as sent to clients: one packed record and its layout, built once per version and shared
        by every message of it (Flower pushes an object the messages share once)."""
        if self._posterior_record is None or self._posterior_record[0] != self.state.version:
            assert self.state.posterior is not None
            self._posterior_record = (self.state.version, *factor_to_record(self.state.posterior))
        return self._posterior_record[1], self._posterior_record[2]

    def _train_message(self, node: int, rnd: int, nth: int = 0) -> Message:
        """The train message of ``node`` in round ``rnd``; ``nth`` > 0 (asynchronous) marks the client's n-th
        message of the round (``round-message``: its local seed differs from the first one's)."""
        cid = self.node_client[node]
        record, layout = self._wire_posterior()
        content = RecordDict(
            {
                P.POSTERIOR: record,
                P.CONFIG: ConfigRecord(
                    {
                        "server-round": rnd,
                        "posterior-version": self.state.version,
                        "site-version": self.ledger_versions.get(cid, P.UNKNOWN_VERSION),
                        P.SITE_TAG: self.ledger_tags.get(cid, ""),
                        "client-id": cid,
                        "rho": self.rho,
                        "has-site": cid in self.resync,
                        layout_key(P.POSTERIOR): layout,
                    }
                ),
            }
        )
        if nth:
            content[P.CONFIG][P.ROUND_MESSAGE] = nth
        if cid in self.resync:
            content[P.SITE], content[P.CONFIG][layout_key(P.SITE)] = factor_to_record(self.state.site(cid))
        return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(rnd))

    def _runtime(self, what: str, call: Callable[[], T], deadline: float) -> T | None:
        """``call()``, retrying transient Runtime API errors with a backoff until ``deadline`` (then ``None``).

        Any other error (HTTP 4xx, a programming error) propagates.  A retried push re-sends the same
        ``Message`` objects (same content-hash ids), so the SuperLink keeps one copy of each.
        """
        attempt = 0
        while True:
            try:
                return call()
            except Exception as err:
                if not _is_transient(err):
                    raise
                attempt += 1
                reason = f"{type(err).__name__}: {_last_line(str(err))}"
                remaining = deadline - time.time()
                if remaining <= 0:
                    self._last_failure = f"Runtime API {what} kept failing until the round deadline ({reason})"
                    log(WARNING, "Runtime API %s failed (%s); giving up after %d attempt(s) at the round deadline",
                        what, reason, attempt)
                    return None
                wait = min(self.retry_backoff * 2 ** (attempt - 1), _RETRY_BACKOFF_MAX, remaining)
                log(WARNING, "Runtime API %s failed (%s); retry %d in %.2fs", what, reason, attempt, wait)
                time.sleep(wait)

    @staticmethod
    def _attribute(replies: Iterable[Message], sent_to: dict[str, int]) -> None:
        """Error replies the SuperLink generates carry its own node id: credit them to the request's node."""
        for m in replies:
            dst = sent_to.get(m.metadata.reply_to_message_id)
            if m.has_error() and dst is not None and m.metadata.src_node_id != dst:
                m.metadata.__dict__["_src_node_id"] = dst

    def _collect(self, grid: Grid, sent_to: dict[str, int], timeout: float) -> list[Message]:
        """Pull the replies to the messages ``sent_to`` (message id -> node id) until all arrived or ``timeout``; at
        least once, so that a reply already in is never counted as a timeout (e.g. the push itself took the time)."""
        ids = set(sent_to)
        out: list[Message] = []
        end = time.time() + timeout
        poll = self._reply_poll()
        first = True
        while ids and (first or time.time() < end):
            first = False
            got = self._runtime("pull-messages", lambda: list(grid.pull_messages(list(ids))), end)
            if got is None:
                break
            self._attribute(got, sent_to)
            out.extend(got)
            ids.difference_update(m.metadata.reply_to_message_id for m in got)
            if got:
                poll.reset()
            elif ids:
                _sleep_until(poll.next_wait(), end)
        return out

    def _reply_poll(self) -> GeometricBackoff:
        """The waits between pulls for replies: ``poll_interval`` after a push or an arrival, growing by
        :data:`POLL_FACTOR` up to ``poll_max`` while nothing arrives.  Replies come in bursts at the end of the
        clients' work; every pull is an HTTP request that costs the SuperLink about 8 ms of CPU (Flower 1.39,
        ``docs/bench_network.md`` section 1k), so a fixed fast poll during minutes of local training is wasted."""
        return GeometricBackoff(self.poll_interval, self.poll_max, POLL_FACTOR)

    def _resend_backoff(self) -> GeometricBackoff:
        """Asynchronous: the waits before re-sending to a node whose messages keep failing, ``resend_first``
        growing by :data:`RESEND_FACTOR` up to ``resend_max``."""
        return GeometricBackoff(self.resend_first, self.resend_max, RESEND_FACTOR)

    def _send_and_receive(self, grid: Grid, msgs: list[Message], timeout: float, stats: RoundStats | None = None,
                          after_push: Callable[[], None] | None = None) -> list[Message] | None:
        """Like ``Grid.send_and_receive`` but polling with :meth:`_reply_poll`'s back-off (the HTTP grid polls every 3 s).

        Pushing and pulling share the ``timeout``; ``None`` when the messages could not be pushed within it.
        With ``stats``, the push and the wait for the replies are timed as its ``push`` and ``wait`` phases.
        ``after_push`` is called once the push has been attempted (also when there is nothing to push); the time it
        takes (the server's own work, e.g. the previous round's pipelined evaluation and checkpoint) is added to the
        replies' time, not taken from it.
        """
        if not msgs:
            if after_push is not None:
                after_push()
            return []
        stats = stats if stats is not None else RoundStats()
        end = time.time() + timeout
        with stats.timed("push"):
            ids = self._runtime("push-messages", lambda: list(grid.push_messages(msgs)), end)
        if after_push is not None:
            started = time.time()
            after_push()
            end += time.time() - started
        if ids is None:
            return None
        with stats.timed("wait"):
            return self._collect(grid, {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs)}, end - time.time())

    # =============================================================================================
    # validating and applying replies
    def _reject(self, rnd: int, client_id: str, node: int, reason: str, stats: RoundStats | None, bad: bool = True) -> None:
        """Log and count a rejected reply; ``bad`` replies (invalid, not merely stale) count towards exclusion."""
        log(WARNING, "round %d: rejected update from client '%s' (node %d): %s", rnd, client_id, node, reason)
        self.rejections.append({"round": rnd, "client-id": client_id, "node-id": node, "reason": reason})
        if stats is not None:
            stats.rejected += 1
        if bad:
            self.bad_replies[client_id] = self.bad_replies.get(client_id, 0) + 1
            limit = self.cfg.max_bad_replies
            if limit and self.bad_replies[client_id] == limit:
                log(WARNING, "client '%s' sent %d bad replies: excluded from the rest of the run", client_id, limit)
                if self.cfg.exclusion_removes_site:
                    self._remove_site(client_id)

    def _remove_site(self, client_id: str) -> None:
        """Divide an excluded client's site out of the posterior: its earlier, accepted updates came from the
        same client and are no longer trusted.  Its ledger version returns to 0 (the uniform site), so were it
        ever contacted again it would be resynchronised to that.

        Sequential and asynchronous runs checkpoint the removal at once (the next message may carry the new
        posterior).  A synchronous round does not: its checkpoints record whole rounds (the round's applied batch,
        then its end), and no client sees the removal before one of them is written; a checkpoint here would hold
        half a round's replies (their rejections and bad-reply counts) with the round still unapplied, and the
        resumed run would send the round again and count those replies twice."""
        if self.ledger_versions.get(client_id, 0) == 0:
            return
        try:
            self.state.remove_site(client_id)
        except UpdateRejected as err:
            log(WARNING, "client '%s': its site stays in the posterior: %s", client_id, err.reason)
            return
        log(WARNING, "client '%s': its site (%d applied updates) was divided out of the posterior", client_id,
            self.ledger_versions[client_id])
        self.ledger_versions[client_id] = 0
        self.ledger_tags.pop(client_id, None)  # the uniform site: no update behind it
        self.resync.add(client_id)
        if self.cfg.schedule != "synchronous":
            self._checkpoint()

    def _decode_replies(self, rnd: int, replies: Iterable[Message], stats: RoundStats,
                        failed_nodes: set[int] | None = None, charge: bool = True) -> list[Reply]:
        """Decode and check train replies (not yet applied); the nodes whose reply is a failure (an error or a
        ``failed`` status) are added to ``failed_nodes``.  An invalid reply counts towards its client's
        max-bad-replies once per message it answers (a copy delivered twice is one bad reply), and not at all
        without ``charge`` (asynchronous: a reply to no message in flight)."""
        out: list[Reply] = []
        seen: set[str] = set()
        charged: set[str] = set()  # the messages whose reply was already counted as a bad one
        for msg in replies:
            node = msg.metadata.src_node_id
            cid = self.node_client.get(node, f"<node {node}>")
            answers = msg.metadata.reply_to_message_id
            if msg.has_error():
                stats.failed += 1
                if failed_nodes is not None:
                    failed_nodes.add(node)
                reason = _last_line(msg.error.reason)
                self._last_failure = f"client '{cid}': {reason}"
                log(WARNING, "round %d: client '%s' failed: %s", rnd, cid, reason)
                continue
            stats.replied += 1
            if node not in self.node_client:  # not a client we sent work to: count it, keep no state for it
                self._reject(rnd, cid, node, "reply from an unknown node", stats, bad=False)
                continue
            try:
                content = msg.content
                cfg = content[P.CONFIG] if P.CONFIG in content else ConfigRecord()
                if not isinstance(cfg, ConfigRecord):  # its values' str() could be an Array's repr
                    raise PGVIError(f"'{P.CONFIG}' is a {type(cfg).__name__}, not a ConfigRecord")
                # every string of the reply that can reach a reason is cut short (reasons are logged, kept in
                # rejections and rewritten into every checkpoint)
                status = cfg.get("status", "")
                if not isinstance(status, str):
                    raise PGVIError(f"status must be a string, got a {type(status).__name__}")
                reported = cfg.get("client-id", "")
                if reported != "" and reported != cid:
                    # a node whose client-id changed (a restart with another node config keeps the node id under
                    # SuperNode authentication): not misbehaviour of the old client; the node is identified again
                    self.node_client.pop(node, None)
                    self._requery.pop(node, None)
                    self._reject(rnd, cid, node, f"reply claims client id {_short(reported)} but node {node} was "
                                 f"'{cid}': the node is asked who it is", stats, bad=False)
                    if self.ledger_versions.get(cid, 0):
                        # an id already in the ledger can be admitted (its node gone): then the partition counts twice
                        # (a reported id that is not a string, e.g. a list, is no id: never in the ledger)
                        full = (not (isinstance(reported, str) and reported in self.ledger_versions)
                                and len(self.ledger_versions) >= self.cfg.num_clients)
                        log(WARNING, "client '%s' (node %d until now) keeps its site (%d applied updates) in the "
                            "posterior: %s", cid, node, self.ledger_versions[cid],
                            f"a new client id is not admitted while the ledger holds num-clients="
                            f"{self.cfg.num_clients} clients (restart the node with client-id '{cid}' to continue "
                            f"its site)" if full else
                            "if the node's data now stands behind another client id, it counts twice")
                    continue
                if status == P.STATUS_RESYNC:
                    stats.resync += 1
                    self.resync.add(cid)
                    log(INFO, "round %d: client '%s' asked for its site (resync)", rnd, cid)
                    continue
                if status == P.STATUS_FAILED:
                    stats.failed += 1
                    if failed_nodes is not None:
                        failed_nodes.add(node)
                    reason = _reply_text(cfg.get("reason", ""))
                    self._last_failure = reason
                    log(WARNING, "round %d: client '%s' could not update: %s", rnd, cid, reason)
                    continue
                if status != P.STATUS_OK:
                    raise PGVIError(f"unknown status {_short(status)}")
                if cid in seen:  # a re-executed or re-delivered message: one reply is applied, the client may have
                    # staged the other one's Delta (a re-execution can compute another): one site transfer
                    # reconciles it, as the version check does for a duplicate arriving in a later batch
                    self.resync.add(cid)
                    for r in out:
                        if r.client_id == cid:
                            r.duplicated = True  # its application must not cancel this resync
                    self._reject(rnd, cid, node, "second reply from the same client in one batch (duplicate)",
                                 stats, bad=False)
                    continue
                if P.DELTA not in content:
                    raise PGVIError("no Delta in the reply")
                record = content[P.DELTA]
                delta = record_to_factor(record, self.problem.prior, cfg.get(layout_key(P.DELTA)))
                base = _strict_int(cfg.get("base-site-version"), "base-site-version")
                sent = _strict_int(cfg.get("posterior-version", self.state.version), "posterior-version")
                tag = cfg.get(P.UPDATE_TAG, "")
                if not isinstance(tag, str) or len(tag) > P.MAX_TAG_CHARS:
                    raise PGVIError(f"{P.UPDATE_TAG} must be a string of at most {P.MAX_TAG_CHARS} characters")
                if base != self.ledger_versions.get(cid):  # duplicate, late, or the site was reset: not misbehaviour
                    self.resync.add(cid)
                    self._reject(rnd, cid, node, f"Delta computed against site version {base}, ledger has "
                                 f"{self.ledger_versions.get(cid)} (duplicate, late or lost client state)", stats,
                                 bad=False)
                    continue
                metrics = self._train_metrics(rnd, cid, node, content[P.METRICS] if P.METRICS in content else {})
                out.append(Reply(node, cid, delta, base, sent, metrics, record.count_bytes(), tag=tag))
                seen.add(cid)
            except PGVIError as err:
                self._reject(rnd, cid, node, str(err), stats, bad=charge and answers not in charged)
                charged.add(answers)
            except Exception as err:  # malformed content must never crash the server
                self._reject(rnd, cid, node, f"malformed reply: {type(err).__name__}: {_reply_text(str(err), 300)}",
                             stats, bad=charge and answers not in charged)
                charged.add(answers)
        return out

    @staticmethod
    def _train_metrics(rnd: int, cid: str, node: int, record: Mapping[str, object]) -> dict[str, float]:
        """The :data:`TRAIN_ROW_METRICS` of a train reply that may go into the round's row.  A metric that is not a
        finite number in [0, 2^53] (``num-examples`` a whole one) is left out with a warning naming the client and
        node; the update itself is judged by its Delta, not by its metrics (NaN, 1e308 or a negative count went into
        the row, the history and the checkpoint as sent)."""
        items = dict(record.items())
        metrics: dict[str, float] = {}
        dropped: list[str] = []
        for key in TRAIN_ROW_METRICS:
            if key not in items:
                continue
            why = _train_metric_problem(key, items[key])
            if why is None:
                metrics[key] = float(items[key])
            else:
                dropped.append(f"{key!r} ({why})")
        if dropped:
            log(WARNING, "round %d: client '%s' (node %d): train metric(s) %s left out of the round's row", rnd, cid,
                node, ", ".join(dropped))
        return metrics

    def _apply_batch(self, rnd: int, decoded: list[Reply], stats: RoundStats, whole_round: bool = False) -> None:
        """Apply the Deltas that keep the posterior proper; the batch is applied atomically.

        A Delta to blame on its own (the server names it, or the server step rejects it alone) is rejected and the
        rest tried again.  A batch that fails only jointly is tried again with every (credited) Delta raised to
        ``2^-j`` (its damping halved ``j`` times) for ``j = 1 .. batch-halvings``: the first that the server accepts
        is applied, its clients are resent their ledger sites (they hold ``site * Delta``), and the round's row says
        ``batch-halvings``; if none is, the batch is rejected as a whole, charging nobody (:meth:`_drop_rejected`).

        ``whole_round`` (synchronous): the batch is all of round ``rnd``'s updates, so its checkpoint records the
        round as applied; a server that dies before the round's record then resumes by recording it, not by
        sending it again.
        """
        ok: list[Reply] = []
        for d in decoded:
            if self._excluded(d.client_id):  # excluded by a later reply of the same batch
                self._reject(rnd, d.client_id, d.node_id, "client excluded (too many bad replies)", stats, bad=False)
                continue
            if d.base_version != self.ledger_versions.get(d.client_id):  # its site was reset since decoding
                self.resync.add(d.client_id)
                self._reject(rnd, d.client_id, d.node_id, f"site version changed to "
                             f"{self.ledger_versions.get(d.client_id)} since the Delta was decoded", stats, bad=False)
                continue
            try:
                self._check_alone(d.delta)
                ok.append(d)
            except PGVIError as err:
                self._reject(rnd, d.client_id, d.node_id, str(err), stats)
            except Exception as err:  # numerical failure on an extreme input: reject, never crash
                self._reject(rnd, d.client_id, d.node_id, f"could not check the Delta: {type(err).__name__}: {err}", stats)
        def aggregate(batch: list[Reply]) -> dict[str, GaussianFactor]:
            # a robust aggregator replaces sum(Delta) by sum(credited); it sees the batch of valid Deltas
            return self.aggregator({d.client_id: d.delta for d in sorted(batch, key=lambda d: d.client_id)}) if batch \
                else {}

        aggregated = aggregate(ok)  # once per batch: the halvings below reuse it
        credited: dict[str, GaussianFactor] = {}
        halvings, first_reason = 0, ""
        while ok:
            credited = aggregated
            if halvings:  # every Delta's damping halved: Delta ** 2^-k in natural parameters
                credited = {cid: c ** (0.5 ** halvings) for cid, c in aggregated.items()}
            try:
                self.state.apply(credited)
                break
            except Exception as err:
                if not isinstance(err, UpdateRejected):  # numerical failure on an extreme input
                    err = UpdateRejected(",".join(credited), f"{type(err).__name__}: {err}")
                # the Deltas to blame on their own: the one the server names, else (first try only: a Delta valid
                # alone at full damping stays so at half of it) those the server step rejects alone
                blame = {d.client_id: err.reason for d in ok if d.client_id == err.client_id}
                if not blame and not halvings:
                    blame = {d.client_id: why for d in ok if (why := self._rejected_alone(d)) is not None}
                if not blame and halvings < self.cfg.batch_halvings:
                    first_reason = first_reason or err.reason
                    halvings += 1
                    continue
                ok = self._drop_rejected(rnd, ok, err, stats, blame, halvings)
                aggregated = aggregate(ok)
                halvings, first_reason = 0, ""
        if ok and halvings:
            stats.batch_halvings = halvings
            log(WARNING, "round %d: the batch of %d Deltas (each valid on its own) failed jointly (%s); applied with "
                "every Delta's damping halved %d time(s) (x %g): %s are resent their ledger sites", rnd, len(ok),
                _reply_text(first_reason), halvings, 0.5 ** halvings, ", ".join(sorted(d.client_id for d in ok)))
        for d in ok:
            if credited[d.client_id] is not d.delta:  # the client holds site*Delta: resend the credited site
                self.resync.add(d.client_id)
        for d in ok:
            self.ledger_versions[d.client_id] = self.ledger_versions.get(d.client_id, 0) + 1
            # the tag of the update behind the new ledger site; a credited site is none the client staged: a fresh
            # tag (sent with the resent site) so that the client's own update is never committed in its place
            self.ledger_tags[d.client_id] = d.tag if credited[d.client_id] is d.delta else f"s{secrets.token_hex(8)}"
            if credited[d.client_id] is d.delta and not d.duplicated:  # the client holds the ledger's site
                self.resync.discard(d.client_id)
        if ok:
            if whole_round:
                self.round_applied = rnd
            self._checkpoint()  # before any client can learn that its update was applied
        for d in ok:
            stats.applied += 1
            stats.reply_bytes += d.reply_bytes
            stats.num_examples += d.metrics.get("num-examples", 0.0)
            if "seconds" in d.metrics:
                stats.client_seconds.append(d.metrics["seconds"])
            if "epochs" in d.metrics:
                stats.client_epochs.append(d.metrics["epochs"])
            stats.starts_narrowed += d.metrics.get("start-narrowed", 0.0) > 0
            stats.domain_cut += d.metrics.get("domain-cuts", 0.0) > 0
            if d.metrics.get("epochs", 0.0) > 0 and d.metrics.get("best-epoch") == 0 and d.metrics.get("polished") != 1:
                stats.at_start += 1
                log(INFO, "round %d: client '%s': its local optimiser returned its start (no epoch of %d improved on "
                    "it): the start was already optimal (a converged run) or the steps are too large (lr, lr-scale)",
                    rnd, d.client_id, int(d.metrics["epochs"]))

    def _check_alone(self, delta: GaussianFactor) -> None:
        """Raise a :class:`PGVIError` if the server step would give an improper posterior with ``delta`` applied
        alone, where the step is a closed form: ``posterior * delta`` for KL, ``posterior * delta ** w`` for the
        weighted KL (``prior * (G delta)^w``; checking ``posterior * delta`` there rejected valid Deltas when
        ``w < 1`` and let improper ones through to the batch when ``w > 1``).  A step solved by optimisation is
        not run once per Delta here: the batch's own step decides, and :meth:`_apply_batch` finds a Delta it
        rejects on its own; any other step is run with the Delta alone."""
        st = self.state
        assert st.posterior is not None
        what = "server posterior after this Delta"
        if st.server_step is kl_server_step:
            (st.posterior * delta).check_proper(what)
        elif isinstance(st.server_step, ServerGVIStep):
            w = st.server_step.closed_form_power
            if w is not None:
                (st.posterior * delta ** w).check_proper(what)
        else:  # another step (a wrapper, a plug-in): run it
            self._step_alone(delta)

    def _step_alone(self, delta: GaussianFactor) -> GaussianFactor:
        """The server step run on the global site times ``delta`` alone, checked proper (a :class:`PGVIError` if
        not)."""
        st = self.state
        assert st.global_site is not None
        return st.server_step(st.prior, st.global_site * delta).check_proper("server posterior after this Delta alone")

    def _drop_rejected(self, rnd: int, ok: list[Reply], err: UpdateRejected, stats: RoundStats,
                       blame: dict[str, str], halvings: int) -> list[Reply]:
        """The Deltas of ``ok`` to try again (re-aggregated) after the server rejected the batch with ``err``.

        The Deltas to blame (``blame``: the client ``err`` names, else those the server step rejects on their own)
        are rejected as bad replies and the others tried again.  If none is to blame on its own, only their
        combination fails (the posterior is improper, or the server optimisation fails, with all of them), also
        with every Delta's damping halved ``halvings`` times (``batch-halvings``, see :meth:`_apply_batch`): the
        whole batch is rejected, but no client is charged a bad reply, for each sent a Delta that was valid as far as
        it could know; honest clients must not be excluded (nor, with ``exclusion-removes-site``, their sites divided
        out) because others updated in the same round.  A rejected client keeps its ledger version, so its next
        message makes it roll its pending update back, as for any rejection.
        """
        if blame:
            for d in ok:
                if d.client_id in blame:
                    self._reject(rnd, d.client_id, d.node_id, f"batch check: {blame[d.client_id]}", stats)
            return [d for d in ok if d.client_id not in blame]
        also = f"; also with every Delta's damping halved {halvings} time(s)" if halvings else ""
        for d in ok:
            self._reject(rnd, d.client_id, d.node_id, f"batch check (jointly with the batch's other Deltas, valid on "
                         f"its own{also}): {err.reason}", stats, bad=False)
        return []

    def _rejected_alone(self, d: Reply) -> str | None:
        """Why the server would reject ``d``'s Delta were it the only one of its batch, else ``None``: the server
        step (not only the KL product checked on decoding) applied to the global site times this Delta."""
        try:
            self._step_alone(d.delta)
        except PGVIError as err:
            return str(err)
        except Exception as err:  # numerical failure on an extreme input: this Delta's, never a crash
            return f"{type(err).__name__}: {err}"
        return None

    # =============================================================================================
    # evaluation and records
    def _record_round(self, rnd: int, stats: RoundStats, grid: Grid, result: Result, do_client_eval: bool,
                      server_metrics: dict[str, float] | None = None) -> None:
        """Evaluate the posterior (unless ``server_metrics`` holds that evaluation, made earlier) and append the
        round's row to the history (``on_round_end``)."""
        extra: dict[str, float] = {}
        if server_metrics is None and self.server_evaluate is not None:
            assert self.state.posterior is not None
            with stats.timed("evaluate"):
                server_metrics = self.server_evaluate(self.state.posterior)
        if server_metrics is not None:
            result.evaluate_metrics_serverapp[rnd] = MetricRecord(server_metrics)
            extra.update({f"test-{k}": v for k, v in server_metrics.items()})
        if do_client_eval and self.cfg.evaluate_clients:
            with stats.timed("client-evaluate"):
                msgs = list(self.configure_evaluate(rnd, self._current_record(), ConfigRecord(), grid))
                agg = self.aggregate_evaluate(rnd, self._send_and_receive(grid, msgs, self.cfg.round_timeout_s) or [])
            if agg is not None:
                result.evaluate_metrics_clientapp[rnd] = agg
                extra.update({k: float(v) for k, v in agg.items()})
        row: dict[str, float] = {"round": float(rnd), "version": float(self.state.version)}
        row.update(stats.as_metrics())
        clashing = sorted(k for k in extra if k in row)
        if clashing:  # the clients name their evaluation metrics: one named like a server statistic
            # ('seconds-max' -> client-seconds-max, from the applied train replies) does not replace it
            log(WARNING, "round %d: client evaluation metric(s) named like the server's own statistics left out: %s",
                rnd, ", ".join(clashing))
        row.update({k: v for k, v in extra.items() if k not in row})
        row["round-seconds"] = (stats.evaluated or time.perf_counter()) - stats.started
        row["started-at"] = stats.started_at  # Unix time
        row["recorded-at"] = time.time()
        self.history.append(row)
        if self.on_round_end is not None:
            self.on_round_end(rnd, row)
