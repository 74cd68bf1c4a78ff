"""Test/deployment PKI for a PGVI Flower federation.

Creates, under one output directory:

- ``ca.crt`` / ``ca.key``: a self-signed certificate authority (ECDSA P-384);
- ``server.pem`` / ``server.key``: the SuperLink certificate, signed by the CA, with
  subjectAltNames ``localhost``, ``127.0.0.1``, ``::1``, ``superlink`` plus any extra
  names/IPs given with ``--san`` (the SuperLink serves the Fleet, Control and Runtime
  APIs with this one certificate, so in Docker its SAN must contain ``superlink``);
- ``keys/site-<k>.key`` / ``keys/site-<k>.pub``: one ECDSA NIST P-384 key pair per
  SuperNode in OpenSSH format, the format ``flwr supernode register`` and
  ``flower-supernode --auth-supernode-private-key`` accept;
- ``runtime/site-<k>.pem`` / ``runtime/site-<k>.key``: one TLS certificate per SuperNode
  for its Runtime API (``flower-supernode --ssl-certfile/--ssl-keyfile``), which a
  separate ``flower-superexec`` reaches at ``supernode-<k>:9094`` in the Docker layout;
  SAN ``supernode-<k>``, ``localhost``, ``127.0.0.1``, ``::1``.

Idempotent: existing files are reused unless ``--force``. A server certificate whose
SAN set lacks a requested name, that was not issued by the current CA, that expires within
7 days or that is not valid yet (notBefore in the future) is re-issued (a silently reused
certificate without the requested name would fail at handshake time). Private keys are
written with mode 0600 and never overwritten in place (write to a temporary file, then
rename). A run holds an exclusive lock on ``<out>/.pki.lock`` from start to end, so two runs
on one directory (two ``deploy.py up`` on one run dir, an overlapping CI retry) cannot mix
their files: the second waits, then reuses what the first wrote.

Lifetimes: a new CA is valid for ``--ca-days`` (default 3650) and the certificates it
issues for ``--days`` (default 365). A certificate is renewed when fewer than 7 days are
left, and the CA issues only while it has at least 30 days left, so ``--days`` must exceed
7 and ``--ca-days`` must be at least ``--days + 37``: the CA can then renew its
certificates instead of forcing a new CA (and a re-distributed ``ca.crt``) on every renewal.

The CA key may live offline: with ``ca.crt`` present but ``ca.key`` absent, nothing is
created when every needed certificate already exists and is valid; when one must be
issued, the tool fails and asks for ``ca.key`` (it never replaces an existing ``ca.crt``
with a new CA unless ``--force``). A reused CA that has expired, that is not valid yet, or
that has fewer than 30 days left when a certificate must be issued, is an error naming the
date; a reused ``ca.crt`` that is not a CA certificate (no basicConstraints ``CA:TRUE``, or a
keyUsage without ``keyCertSign``) is an error too. Every such error, and every file that
cannot be parsed, is a :class:`PkiError` naming the file.

Nothing generated here is meant to be committed: ``.gitignore`` ignores every ``certs/``
directory (the repo's and each deployment's ``runs/<dir>/certs/``) and every ``*.key``,
``*.pem`` and ``*.crt``; ``tests/test_pki.py`` checks that and that no key is tracked.

The node keys are what SuperNode authentication (on by default in ``scripts/deploy.py`` and
``docker-compose.yml``) is based on: each public key is registered with the SuperLink
(``flwr supernode register keys/site-k.pub <conn> --name site-k``) before SuperNode ``k``
starts with ``--auth-supernode-private-key keys/site-k.key``.

Usage::

    python scripts/pki.py --out certs/ --supernodes 3 [--san my.host --san 10.0.0.5] [--days 365 --ca-days 3650]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import fcntl
import ipaddress
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DEFAULT_CA_DAYS",
    "DEFAULT_DAYS",
    "DEFAULT_SAN_DNS",
    "DEFAULT_SAN_IPS",
    "NodeKeyPair",
    "PkiError",
    "PkiFiles",
    "RuntimeCert",
    "cert_covers_host",
    "ensure_pki",
    "generate_node_keypair",
    "load_ca_cert",
    "main",
    "node_key_name",
    "split_sans",
    "verify_pki_files",
]

#: Names always present in the SuperLink certificate.
DEFAULT_SAN_DNS: tuple[str, ...] = ("localhost", "superlink")
#: Addresses always present in the SuperLink certificate.
DEFAULT_SAN_IPS: tuple[str, ...] = ("127.0.0.1", "::1")

_CURVE = ec.SECP384R1
_HASH = hashes.SHA384
#: Re-issue a reused server certificate that expires within this many days.
_RENEW_MARGIN_DAYS = 7
#: Refuse to issue a certificate from a reused CA that expires within this many days.
_CA_MIN_REMAINING_DAYS = 30
#: Default lifetime of a new CA: much longer than a leaf's, so the same CA can renew its leaves.
DEFAULT_CA_DAYS = 3650
#: Default lifetime of a new leaf certificate.
DEFAULT_DAYS = 365
#: Lock file held (``flock``, exclusive) by every :func:`ensure_pki` run on a directory.
LOCK_NAME = ".pki.lock"


class PkiError(ValueError):
    """A PKI file is unusable (unreadable, malformed, not a CA, outside its validity window) or an option is
    out of range.  The message names the file or the option.  A ``ValueError``, so callers that caught those
    keep working."""


@dataclass(frozen=True)
class NodeKeyPair:
    """One SuperNode's authentication key pair (OpenSSH format)."""

    name: str
    private_key: Path
    public_key: Path


@dataclass(frozen=True)
class RuntimeCert:
    """TLS certificate + key of one SuperNode's Runtime API (signed by the CA)."""

    name: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class PkiFiles:
    """Paths of everything :func:`ensure_pki` produced or reused."""

    out_dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[NodeKeyPair, ...]
    runtime_certs: tuple[RuntimeCert, ...] = ()


def node_key_name(k: int) -> str:
    """Logical name of SuperNode ``k`` (also its ``client-id`` and registered name)."""
    if k < 0:
        raise ValueError(f"node index must be >= 0, got k={k}")
    return f"site-{k}"


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _valid_dns_name(name: str) -> bool:
    """A DNS name: dot-separated labels of letters, digits and hyphens (not at a label's ends, at most 63
    characters), at most 253 characters, optionally with a leading ``*.`` wildcard label."""
    body = name[2:] if name.startswith("*.") else name
    body = body[:-1] if body.endswith(".") else body
    return 0 < len(body) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in body.split("."))


def _strip_root_dot(name: str) -> str:
    """``name`` without one trailing dot: ``my.host.`` (the fully-qualified spelling) is ``my.host``, the name
    a certificate lists and a TLS client compares against."""
    return name[:-1] if name.endswith(".") else name


def _san_ip(name: str, bare: str) -> str | None:
    """``bare`` as a normalised IP address if it is one (``None`` if not), refusing what no client dials: an IPv6
    zone id (``fe80::1%eth0``: local to one host, and a certificate holds only the 16 address bytes) and the
    unspecified address (``0.0.0.0``, ``::``: a bind-to-all address)."""
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if getattr(ip, "scope_id", None):
        raise ValueError(
            f"san: {name!r} has an IPv6 zone id ('%{ip.scope_id}'), which names an interface of one host and "
            f"cannot be in a certificate; give the address without it ({str(ip).split('%')[0]})"
        )
    if ip.is_unspecified:
        raise ValueError(
            f"san: {name!r} is the unspecified address (bind to all interfaces), not an address a client "
            "connects to; give the address or name the clients dial"
        )
    return str(ip)


def _san_dns(name: str) -> str:
    """``name`` as a DNS subjectAltName without a trailing dot, or a ``ValueError`` naming it."""
    if ":" in name:
        raise ValueError(
            f"san: {name!r} is not a DNS name or IP address (a subjectAltName has no port: drop the ':PORT')"
        )
    if not _valid_dns_name(name):
        raise ValueError(
            f"san: {name!r} is neither an IP address nor a valid DNS name (labels of letters, "
            f"digits and hyphens separated by dots, optionally starting with '*.')"
        )
    dns = _strip_root_dot(name)
    if re.fullmatch(r"[0-9.]+", dns):  # 127.1, 10.0.0, 192.168.001.1: a mistyped address, not a host name
        raise ValueError(
            f"san: {name!r} is made only of digits and dots but is not a valid IP address; write the "
            "address in full (four decimal parts without leading zeros, e.g. 127.0.0.1)"
        )
    return dns


def split_sans(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split SAN entries into (DNS names, IP addresses), dropping duplicates.

    IP addresses may be bracketed (``[2001:db8::5]``); a DNS name loses one trailing dot (``my.host.`` is
    ``my.host``, as :func:`cert_covers_host` compares it).  A SAN is a name a client dials, so a port
    (``host:9092``), an IPv6 zone id (``fe80::1%eth0``), an unspecified address (``0.0.0.0``, ``::``), a
    "DNS name" made only of digits and dots (``127.1``: a mistyped address) and anything else that is not a
    valid DNS name is a ``ValueError`` naming the entry.
    """
    dns: list[str] = []
    ips: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            raise ValueError("san: empty subjectAltName entry")
        bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
        ip = _san_ip(name, bare)
        if ip is not None:
            if ip not in ips:
                ips.append(ip)
            continue
        if bare != name:
            raise ValueError(f"san: {name!r}: only an IPv6 address may be written in brackets")
        host = _san_dns(name)
        if host.lower() not in (d.lower() for d in dns):
            dns.append(host)
    return dns, ips


# --------------------------------------------------------------------------- file I/O


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` set before any byte is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # umask must not widen or narrow the mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write_private_pem(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write_atomic(path, pem, 0o600)


def _load_private_pem(path: Path) -> ec.EllipticCurvePrivateKey:
    """The unencrypted EC private key in ``path``; :class:`PkiError` naming the file if it is anything else
    (an ``OSError`` reading it propagates: it names the file too)."""
    data = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:  # TypeError: encrypted, needs a password
        raise PkiError(f"{path}: not a readable unencrypted PEM private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path}: expected an EC private key, got {type(key).__name__}")
    return key


def _load_cert(path: Path) -> x509.Certificate:
    """The PEM certificate in ``path``; :class:`PkiError` naming the file if it cannot be parsed."""
    data = path.read_bytes()
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as err:
        raise PkiError(f"{path}: not a readable PEM certificate ({err})") from None


def _with_existing_sans(cert_p: Path, dns: list[str], ips: list[str], say) -> tuple[list[str], list[str]]:
    """``dns`` and ``ips`` plus the names of the certificate already in ``cert_p`` (none if it is missing, cannot
    be parsed or has no subjectAltName).  A certificate issued with ``--san fl.example.org`` and renewed by a run
    without it (``--supernodes 4`` to add a node, an expiring certificate) lost that name, and every client that
    dials it failed its TLS check; ``--force`` starts from the names given."""
    try:
        san = _load_cert(cert_p).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, PkiError, x509.ExtensionNotFound):
        return dns, ips
    have_dns, have_ips = {d.lower() for d in dns}, set(ips)
    kept_dns = [d for d in san.get_values_for_type(x509.DNSName) if d.lower() not in have_dns]
    kept_ips = [str(i) for i in san.get_values_for_type(x509.IPAddress) if str(i) not in have_ips]
    if kept_dns or kept_ips:
        say(f"{cert_p.name} keeps the names it was issued for: {', '.join(kept_dns + kept_ips)}")
    return dns + kept_dns, ips + kept_ips


def _ensure_private_mode(path: Path) -> None:
    if path.exists() and (path.stat().st_mode & 0o077):
        os.chmod(path, 0o600)


def _make_out_dir(out: Path) -> None:
    """Create ``out`` (mode 0700; an existing directory keeps its mode), or :class:`PkiError` if it is a file.

    ``exist_ok``: a concurrent run may create it between a check and the ``mkdir``."""
    if out.exists() and not out.is_dir():
        raise PkiError(f"output directory {out} exists and is not a directory")
    out.mkdir(parents=True, mode=0o700, exist_ok=True)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<out>/.pki.lock`` (waiting for it if another run holds it).

    Without it, two runs on one fresh directory each create a CA and write their files over each other's,
    leaving a ``ca.crt`` that does not match ``ca.key`` or certificates no CA here issued, and both exit 0.
    The lock file is kept (removing it would let a third run lock a new file while the second holds the
    old one); the kernel releases the lock when the descriptor is closed, also if the process dies.

    A directory this run cannot write (a read-only mount, or another user's PKI that is only reused) has no
    lock file: the run locks the directory itself instead (it can write nothing there, so it only reads).

    A filesystem without working locks (NFS without a lock manager: ``ENOLCK``) raises an ``OSError`` (same
    errno) naming the file it could not lock and saying to keep the PKI directory on a local filesystem; the
    bare ``[Errno 37] No locks available`` named neither."""
    locked = out / LOCK_NAME
    try:
        fd = os.open(locked, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        locked = out
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            raise OSError(err.errno, f"cannot lock {locked} ({err.strerror or err}): its filesystem does not "
                          "support flock (NFS without a lock manager?); put the PKI directory on a local "
                          "filesystem (scripts/deploy.py: a --run-dir there, or give files made elsewhere with "
                          "--certs, which are only read)") from err
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- X.509


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _make_ca(common_name: str, valid_days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(_CURVE())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, _HASH())
    )
    return key, cert


def _make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    server_key: ec.EllipticCurvePrivateKey,
    dns: Sequence[str],
    ips: Sequence[str],
    valid_days: int,
) -> x509.Certificate:
    now = _now()
    cn = dns[0] if dns else ips[0]
    san = x509.SubjectAlternativeName(
        [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    )
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(
            min(now + _dt.timedelta(days=valid_days), ca_cert.not_valid_after_utc)
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, _HASH())
    )


def _check_is_ca(path: Path, cert: x509.Certificate) -> None:
    """:class:`PkiError` unless ``cert`` may sign certificates: basicConstraints ``CA:TRUE`` and, if it has a
    keyUsage (optional, RFC 5280 4.2.1.3), ``keyCertSign``.  What a non-CA "signs" verifies nowhere."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    except ValueError as err:  # a malformed or duplicated extension
        raise PkiError(f"{path}: unreadable certificate extensions ({err})") from None
    if constraints is None or not constraints.ca:
        raise PkiError(
            f"{path} is not a CA certificate (no basicConstraints CA:TRUE), so nothing it signs verifies: "
            "put the CA's own ca.crt/ca.key here, or create a new CA with --force and re-distribute ca.crt"
        )
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not usage.key_cert_sign:
        raise PkiError(
            f"{path} is not a CA certificate (its keyUsage lacks keyCertSign), so nothing it signs verifies: "
            "put the CA's own ca.crt/ca.key here, or create a new CA with --force and re-distribute ca.crt"
        )


def _check_ca_validity(path: Path, cert: x509.Certificate) -> None:
    """:class:`PkiError` naming ``path`` if the CA is not valid now: expired, or not valid yet (made on a host
    whose clock ran ahead, or this host's clock is behind; a new CA's notBefore is 5 minutes in the past, so
    ordinary skew is covered)."""
    now = _now()
    start, expiry = cert.not_valid_before_utc, cert.not_valid_after_utc
    if start > now:
        raise PkiError(
            f"CA certificate {path} is not valid before {start:%Y-%m-%d %H:%M} UTC (now {now:%Y-%m-%d %H:%M} UTC): "
            "nothing it signed verifies yet; check this host's clock (and the clock of the host that made the "
            "CA), or create a new CA with --force and re-distribute ca.crt"
        )
    if expiry <= now:
        raise PkiError(
            f"CA certificate {path} expired on {expiry:%Y-%m-%d %H:%M} UTC: nothing it "
            "signed verifies any more; create a new CA with --force and re-distribute ca.crt"
        )


def _check_ca(path: Path, cert: x509.Certificate) -> None:
    """:class:`PkiError` naming ``path`` unless ``cert`` is a CA certificate (:func:`_check_is_ca`) valid now
    (:func:`_check_ca_validity`)."""
    _check_is_ca(path, cert)
    _check_ca_validity(path, cert)


def load_ca_cert(path: str | os.PathLike[str]) -> x509.Certificate:
    """Load ``ca.crt`` and check that it is a CA certificate valid now; :class:`PkiError` naming the file
    otherwise (an ``OSError`` reading it propagates)."""
    path = Path(path)
    cert = _load_cert(path)
    _check_ca(path, cert)
    return cert


def _leaf_problem(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    dns: Sequence[str],
    ips: Sequence[str],
    *,
    renew_margin_days: int = _RENEW_MARGIN_DAYS,
) -> str | None:
    """Why the existing leaf certificate cannot be reused (``None``: it can).

    Reusable means: issued by this CA, matching its key, valid now (notBefore not in the future) and for at
    least ``renew_margin_days`` more days, and its SANs cover ``dns`` and ``ips``.
    """
    if not (cert_path.exists() and key_path.exists()):
        return "missing"
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except Exception:  # noqa: BLE001 - unreadable: re-issue
        return "unreadable certificate"
    try:
        key = _load_private_pem(key_path)
    except Exception:  # noqa: BLE001 - unreadable key: re-issue (with a new key)
        return f"{key_path.name} unreadable"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except Exception:  # noqa: BLE001 - foreign CA, bad signature: re-issue
        return "not issued by this CA"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return f"does not match {key_path.name}"
    now = _now()
    if cert.not_valid_before_utc > now:
        return f"not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    if cert.not_valid_after_utc <= now:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d}"
    if cert.not_valid_after_utc - now < _dt.timedelta(days=renew_margin_days):
        return f"expires on {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "has no subjectAltName"
    have_dns = {d.lower() for d in san.get_values_for_type(x509.DNSName)}
    have_ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    lacking = [d for d in dns if d.lower() not in have_dns] + [i for i in ips if i not in have_ips]
    if lacking:
        return f"SAN lacks {', '.join(lacking)}"
    return None


def _server_cert_reusable(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    dns: Sequence[str],
    ips: Sequence[str],
) -> bool:
    """True when the existing server cert is from this CA, matches its key, covers the SANs."""
    return _leaf_problem(cert_path, key_path, ca_cert, dns, ips) is None


def verify_pki_files(
    ca_cert: str | os.PathLike[str],
    leaves: Iterable[tuple[str | os.PathLike[str], str | os.PathLike[str]]] = (),
    node_keys: Iterable[tuple[str | os.PathLike[str], str | os.PathLike[str]]] = (),
) -> list[str]:
    """Check a PKI made elsewhere (``deploy.py --certs``) with the checks :func:`ensure_pki` applies, without
    changing anything, so that a bad file is reported before a server starts with it.

    ``ca_cert`` must be a CA certificate valid now; each ``(cert, key)`` of ``leaves`` must be issued by it,
    match its key and be valid now (SAN coverage is the caller's: :func:`cert_covers_host`); each
    ``(private, public)`` of ``node_keys`` must be a matching EC OpenSSH key pair.  Raises :class:`PkiError`
    naming the first unusable file (an ``OSError`` reading one propagates).  Returns warnings: the CA or a
    certificate that is still valid but expires soon.
    """
    ca_path = Path(ca_cert)
    ca = load_ca_cert(ca_path)
    warnings: list[str] = []
    if ca.not_valid_after_utc - _now() < _dt.timedelta(days=_CA_MIN_REMAINING_DAYS):
        warnings.append(f"CA certificate {ca_path} expires on {ca.not_valid_after_utc:%Y-%m-%d} UTC")
    for cert_p, key_p in leaves:
        cert_p, key_p = Path(cert_p), Path(key_p)
        why = _leaf_problem(cert_p, key_p, ca, (), (), renew_margin_days=0)
        if why is not None:
            raise PkiError(f"{cert_p}: {why} (CA {ca_path})")
        # usable: what is left of ensure_pki's reuse test is its renewal margin
        expiry = _load_cert(cert_p).not_valid_after_utc
        if expiry - _now() < _dt.timedelta(days=_RENEW_MARGIN_DAYS):
            warnings.append(f"certificate {cert_p} expires on {expiry:%Y-%m-%d} UTC")
    for priv_p, pub_p in node_keys:
        priv_p, pub_p = Path(priv_p), Path(pub_p)
        if not _node_keypair_valid(priv_p, pub_p):
            raise PkiError(f"{priv_p} / {pub_p}: missing or not a matching EC OpenSSH key pair")
    return warnings


def cert_covers_host(cert_path: str | os.PathLike[str], host: str) -> bool:
    """True when the certificate's subjectAltNames contain ``host`` (an IP or a DNS name;
    a ``*.example.org`` entry covers one leftmost label).  One trailing dot is ignored on both sides
    (``my.host.`` is ``my.host``, as in :func:`split_sans`); an IPv6 zone id never matches (a SAN has none).
    A certificate that cannot be parsed is a :class:`PkiError` naming the file."""
    cert = _load_cert(Path(cert_path))
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = _strip_root_dot(host.lower())
        for d in san.get_values_for_type(x509.DNSName):
            d = _strip_root_dot(d.lower())
            if d == name or (d.startswith("*.") and "." in name and name.split(".", 1)[1] == d[2:]):
                return True
        return False
    return ip in san.get_values_for_type(x509.IPAddress)


def _ensure_leaf(
    cert_p: Path,
    key_p: Path,
    ca_key: ec.EllipticCurvePrivateKey | None,
    ca_cert: x509.Certificate,
    dns: Sequence[str],
    ips: Sequence[str],
    *,
    renew: bool,
    valid_days: int,
    say,
) -> None:
    """Reuse ``cert_p``/``key_p`` when valid for this CA and SAN set, else (re-)issue.

    The caller has checked (:func:`ensure_pki`) that ``ca_key`` is available whenever a
    certificate must be issued."""
    if not renew and _server_cert_reusable(cert_p, key_p, ca_cert, dns, ips):
        _ensure_private_mode(key_p)
        say(f"reuse certificate {cert_p}")
        return
    if key_p.exists() and not renew:
        try:
            leaf_key = _load_private_pem(key_p)
        except Exception:  # noqa: BLE001 - unreadable key: replace it
            leaf_key = ec.generate_private_key(_CURVE())
            _write_private_pem(key_p, leaf_key)
        _ensure_private_mode(key_p)
    else:
        leaf_key = ec.generate_private_key(_CURVE())
        _write_private_pem(key_p, leaf_key)
    assert ca_key is not None, "ensure_pki checks the CA key before issuing"
    cert = _make_server_cert(ca_key, ca_cert, leaf_key, dns, ips, valid_days)
    _write_atomic(cert_p, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    say(f"new certificate {cert_p} (SAN: {', '.join([*dns, *ips])})")


# --------------------------------------------------------------------------- SSH keys


def generate_node_keypair(private_path: Path, public_path: Path, comment: str) -> None:
    """Write a fresh ECDSA P-384 key pair in OpenSSH format (private 0600, public 0644)."""
    key = ec.generate_private_key(_CURVE())
    priv = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write_atomic(private_path, priv, 0o600)
    _write_atomic(public_path, pub + f" {comment}\n".encode(), 0o644)


def _node_keypair_valid(private_path: Path, public_path: Path) -> bool:
    if not (private_path.exists() and public_path.exists()):
        return False
    try:
        priv = serialization.load_ssh_private_key(private_path.read_bytes(), password=None)
        pub = serialization.load_ssh_public_key(public_path.read_bytes())
    except Exception:  # noqa: BLE001
        return False
    if not isinstance(priv, ec.EllipticCurvePrivateKey) or not isinstance(pub, ec.EllipticCurvePublicKey):
        return False
    return priv.public_key().public_numbers() == pub.public_numbers()


# --------------------------------------------------------------------------- main API


def _check_lifetimes(valid_days: int, ca_valid_days: int) -> None:
    """:class:`PkiError` unless a leaf can be reused between renewals and the CA can renew its leaves.

    A leaf is renewed when fewer than ``_RENEW_MARGIN_DAYS`` days are left, so a lifetime at or below that
    margin would be re-issued on every run; and a CA issues only while it has ``_CA_MIN_REMAINING_DAYS`` days
    left, so a CA that does not outlive its leaves by both margins could not renew them (every renewal would
    need a new CA and a re-distributed ``ca.crt``)."""
    if valid_days <= _RENEW_MARGIN_DAYS:
        raise PkiError(
            f"valid_days (--days) must be more than {_RENEW_MARGIN_DAYS}: a certificate is renewed when fewer than "
            f"{_RENEW_MARGIN_DAYS} days are left, so a shorter one would be re-issued on every run; got {valid_days}"
        )
    least = valid_days + _CA_MIN_REMAINING_DAYS + _RENEW_MARGIN_DAYS
    if ca_valid_days < least:
        raise PkiError(
            f"ca_valid_days (--ca-days) must be at least valid_days (--days) + {_CA_MIN_REMAINING_DAYS} + "
            f"{_RENEW_MARGIN_DAYS} = {least}: the CA issues only while it has {_CA_MIN_REMAINING_DAYS} days left "
            f"and a certificate is renewed {_RENEW_MARGIN_DAYS} days before it expires, so a shorter-lived CA "
            f"could not renew the certificates it issues; got {ca_valid_days}"
        )


def ensure_pki(
    out_dir: str | os.PathLike[str],
    num_supernodes: int = 0,
    extra_sans: Iterable[str] = (),
    *,
    force: bool = False,
    valid_days: int = DEFAULT_DAYS,
    ca_valid_days: int = DEFAULT_CA_DAYS,
    ca_common_name: str = "pgvi-flower-ca",
    runtime_certs: bool = True,
    log=None,
) -> PkiFiles:
    """Create (or reuse) the CA, SuperLink certificate and ``num_supernodes`` node keys.

    The whole run holds an exclusive lock on ``<out_dir>/.pki.lock``: a concurrent run on the same directory
    waits, then reuses what this one wrote.

    Parameters
    ----------
    out_dir:
        Output directory (created with mode 0700 if missing; an existing file there is a ``PkiError``).
    num_supernodes:
        Number of SuperNode key pairs ``keys/site-0 .. keys/site-(n-1)``.
    extra_sans:
        Extra DNS names / IP addresses for the SuperLink certificate (see :func:`split_sans`).
    force:
        Regenerate everything, including the CA and the node keys.
        Without it an existing ``ca.crt`` is always kept; if ``ca.key`` is absent (kept
        offline), only existing valid certificates are used and ``ValueError`` is raised
        when one would have to be issued. A CA that is not a CA certificate, that has expired
        or is not valid yet, or one with fewer than 30 days left when a certificate must be
        issued, raises :class:`PkiError` (a ``ValueError``) naming the file.
    runtime_certs:
        Also issue one Runtime API certificate per SuperNode (``runtime/site-k.pem``).
    valid_days:
        Validity of newly issued certificates; more than 7 (the renewal margin).
    ca_valid_days:
        Validity of a new CA; at least ``valid_days + 37`` (the CA's 30-day issuing margin plus the
        7-day renewal margin), so that the CA can renew the certificates it issued.
    log:
        Optional ``callable(str)`` receiving one line per action.

    Unparsable files raise :class:`PkiError` naming them; an ``OSError`` (unreadable file, unwritable
    directory) propagates.
    """
    if num_supernodes < 0:
        raise PkiError(f"num_supernodes must be >= 0, got {num_supernodes}")
    _check_lifetimes(valid_days, ca_valid_days)
    dns, ips = split_sans([*DEFAULT_SAN_DNS, *DEFAULT_SAN_IPS, *extra_sans])
    out = Path(out_dir).expanduser().resolve()
    _make_out_dir(out)
    with _locked(out):
        return _ensure_pki_locked(
            out, num_supernodes, dns, ips, force=force, valid_days=valid_days, ca_valid_days=ca_valid_days,
            ca_common_name=ca_common_name, runtime_certs=runtime_certs, say=log or (lambda _msg: None),
        )  # fmt: skip


def _refuse_unreadable(out: Path, num_supernodes: int, runtime_certs: bool) -> None:
    """Raise :class:`PkiError` naming every existing file of ``out`` this process may not read, before anything
    is written.  docs/deploy.md hands the private keys the containers mount to their uid (49999): taken for damaged
    files, they were replaced by new keys the containers could not read."""
    names = ["ca.crt", "ca.key", "server.pem", "server.key"]
    for k in range(num_supernodes):
        name = node_key_name(k)
        names += [f"keys/{name}.key", f"keys/{name}.pub"]
        if runtime_certs:
            names += [f"runtime/{name}.pem", f"runtime/{name}.key"]
    denied = []
    for name in names:
        path = out / name
        try:
            if path.is_file():
                path.read_bytes()
        except PermissionError:
            denied.append(str(path))
    if denied:
        raise PkiError(
            f"cannot read {', '.join(denied)} (permission denied: given to the containers' uid by docs/deploy.md's "
            "chown?). Nothing was written: run pki.py again with sudo, then give any new private key it writes to "
            "that uid (sudo chown 49999:49999 <key>)"
        )


def _reuse_ca(ca_cert_p: Path, ca_key_p: Path, say) -> tuple[ec.EllipticCurvePrivateKey | None, x509.Certificate]:
    """Load the existing CA: ``ca.crt`` (a CA certificate valid now) and, if present, the matching ``ca.key``
    (``None`` when it is kept offline)."""
    ca_cert = _load_cert(ca_cert_p)
    ca_key: ec.EllipticCurvePrivateKey | None = None
    if ca_key_p.exists():
        ca_key = _load_private_pem(ca_key_p)
        if ca_cert.public_key().public_numbers() != ca_key.public_key().public_numbers():
            raise PkiError(f"{ca_cert_p} does not match {ca_key_p}; use --force to regenerate")
    _check_ca(ca_cert_p, ca_cert)
    if ca_key is not None:
        _ensure_private_mode(ca_key_p)
        say(f"reuse CA {ca_cert_p}")
    else:
        say(f"reuse CA {ca_cert_p} (no ca.key here: only existing certificates can be used)")
    return ca_key, ca_cert


def _ensure_pki_locked(
    out: Path,
    num_supernodes: int,
    dns: list[str],
    ips: list[str],
    *,
    force: bool,
    valid_days: int,
    ca_valid_days: int,
    ca_common_name: str,
    runtime_certs: bool,
    say,
) -> PkiFiles:
    """:func:`ensure_pki` once ``out`` exists and its lock is held."""
    keys_dir = out / "keys"
    keys_dir.mkdir(mode=0o700, exist_ok=True)

    ca_cert_p, ca_key_p = out / "ca.crt", out / "ca.key"
    srv_cert_p, srv_key_p = out / "server.pem", out / "server.key"
    if not force:
        _refuse_unreadable(out, num_supernodes, runtime_certs)

    # --- CA
    # ca.crt without ca.key: the operator moved the CA key offline (good practice). Never
    # create a new CA over it (that would break every distributed ca.crt): reuse what exists
    # and fail below if something must be issued.
    if not force and ca_key_p.exists() and not ca_cert_p.exists():
        raise PkiError(
            f"{ca_key_p} exists but {ca_cert_p} does not: restore ca.crt (or remove ca.key, or "
            "use --force to create a new CA and re-distribute ca.crt)"
        )
    new_ca = force or not ca_cert_p.exists()
    ca_key: ec.EllipticCurvePrivateKey | None
    if not new_ca:
        ca_key, ca_cert = _reuse_ca(ca_cert_p, ca_key_p, say)
    else:
        ca_key, ca_cert = _make_ca(ca_common_name, valid_days=ca_valid_days)
    ca_expiry = ca_cert.not_valid_after_utc

    # --- which certificates must be (re-)issued: decided before anything is written
    renew = force or new_ca
    if not force:  # a re-issued server certificate keeps the names it was issued for (a renewal without --san)
        dns, ips = _with_existing_sans(srv_cert_p, dns, ips, say)
    rt_dir = out / "runtime"
    leaves: list[tuple[Path, Path, list[str], list[str]]] = [(srv_cert_p, srv_key_p, dns, ips)]
    if runtime_certs and num_supernodes:
        for k in range(num_supernodes):
            name = node_key_name(k)
            rt_dns, rt_ips = split_sans([f"supernode-{k}", "localhost", *DEFAULT_SAN_IPS])
            leaves.append((rt_dir / f"{name}.pem", rt_dir / f"{name}.key", rt_dns, rt_ips))
    if not renew:
        todo = [(c, why) for c, k, d, i in leaves if (why := _leaf_problem(c, k, ca_cert, d, i))]
        if todo:
            what = "; ".join(f"{c} ({why})" for c, why in todo)
            if ca_key is None:
                raise PkiError(
                    f"must issue {what}, but the CA private key {ca_key_p} is missing (only "
                    f"{ca_cert_p} is there): restore ca.key from where it is kept offline, or "
                    "provide the needed certificates, issued by this CA, in this directory"
                )
            if ca_expiry - _now() < _dt.timedelta(days=_CA_MIN_REMAINING_DAYS):
                raise PkiError(
                    f"must issue {what}, but the CA certificate {ca_cert_p} expires on "
                    f"{ca_expiry:%Y-%m-%d %H:%M} UTC (less than {_CA_MIN_REMAINING_DAYS} days left), "
                    "so the certificate would soon be useless: create a new CA with --force and "
                    "re-distribute ca.crt"
                )
        elif ca_expiry - _now() < _dt.timedelta(days=_CA_MIN_REMAINING_DAYS):
            say(f"WARNING: CA certificate {ca_cert_p} expires on {ca_expiry:%Y-%m-%d} UTC")

    if new_ca:
        assert ca_key is not None
        _write_private_pem(ca_key_p, ca_key)
        _write_atomic(ca_cert_p, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        say(f"new CA {ca_cert_p}")

    # --- SuperLink certificate (Fleet, Control and Runtime APIs)
    _ensure_leaf(srv_cert_p, srv_key_p, ca_key, ca_cert, dns, ips,
                 renew=renew, valid_days=valid_days, say=say)  # fmt: skip

    # --- SuperNode key pairs
    pairs: list[NodeKeyPair] = []
    for k in range(num_supernodes):
        name = node_key_name(k)
        priv_p, pub_p = keys_dir / f"{name}.key", keys_dir / f"{name}.pub"
        if not force and _node_keypair_valid(priv_p, pub_p):
            _ensure_private_mode(priv_p)
            say(f"reuse node key {priv_p}")
        else:
            if not force and (priv_p.exists() or pub_p.exists()):
                raise PkiError(
                    f"{priv_p} / {pub_p} exist but are not a matching EC OpenSSH key pair; "
                    "remove them or use --force"
                )
            generate_node_keypair(priv_p, pub_p, comment=name)
            say(f"new node key {priv_p}")
        pairs.append(NodeKeyPair(name=name, private_key=priv_p, public_key=pub_p))

    # --- per-SuperNode Runtime API certificates (SuperExec -> SuperNode, Docker layout)
    runtime: list[RuntimeCert] = []
    if runtime_certs and num_supernodes:
        rt_dir.mkdir(mode=0o700, exist_ok=True)
        for k, (cert_p, key_p, rt_dns, rt_ips) in enumerate(leaves[1:]):
            _ensure_leaf(cert_p, key_p, ca_key, ca_cert, rt_dns, rt_ips,
                         renew=renew, valid_days=valid_days, say=say)  # fmt: skip
            runtime.append(RuntimeCert(name=node_key_name(k), cert=cert_p, key=key_p))

    return PkiFiles(
        out_dir=out,
        ca_cert=ca_cert_p,
        ca_key=ca_key_p,
        server_cert=srv_cert_p,
        server_key=srv_key_p,
        node_keys=tuple(pairs),
        runtime_certs=tuple(runtime),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pki.py",
        description="Create a CA, a SuperLink TLS certificate and SuperNode auth keys.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory, e.g. certs/")
    parser.add_argument(
        "--supernodes", type=int, default=0, help="number of SuperNode key pairs (site-0..)"
    )
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        help="extra subjectAltName for the SuperLink certificate (DNS name or IP); repeatable",
    )
    parser.add_argument(
        "--days", type=int, default=DEFAULT_DAYS,
        help=f"validity of newly issued certificates in days (default {DEFAULT_DAYS}; more than "
             f"{_RENEW_MARGIN_DAYS}, the renewal margin)",
    )  # fmt: skip
    parser.add_argument(
        "--ca-days", type=int, default=DEFAULT_CA_DAYS,
        help=f"validity of a new CA in days (default {DEFAULT_CA_DAYS}); at least --days + "
             f"{_CA_MIN_REMAINING_DAYS + _RENEW_MARGIN_DAYS}, so that the CA can renew the certificates it issues",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true", help="regenerate everything (new CA: re-distribute ca.crt)"
    )
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        files = ensure_pki(
            args.out,
            args.supernodes,
            args.san,
            force=args.force,
            valid_days=args.days,
            ca_valid_days=args.ca_days,
            log=None if args.quiet else (lambda m: print(m, file=sys.stderr)),
        )
    except (ValueError, OSError) as err:  # PkiError, a bad option, an unreadable file or unwritable directory
        print(f"pki.py: error: {err}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"CA certificate:      {files.ca_cert}")
        print(f"SuperLink cert/key:  {files.server_cert} {files.server_key}")
        for pair in files.node_keys:
            print(f"SuperNode {pair.name} auth key:     {pair.private_key} {pair.public_key}")
        for rt in files.runtime_certs:
            print(f"SuperNode {rt.name} runtime cert: {rt.cert} {rt.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
