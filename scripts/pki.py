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
SAN set lacks a requested name, or that was not issued by the current CA, is re-issued
(a silently reused certificate without the requested name would fail at handshake
time). Private keys are written with mode 0600 and never overwritten in place (write to
a temporary file, then rename).

The CA key may live offline: with ``ca.crt`` present but ``ca.key`` absent, nothing is
created when every needed certificate already exists and is valid; when one must be
issued, the tool fails and asks for ``ca.key`` (it never replaces an existing ``ca.crt``
with a new CA unless ``--force``). A reused CA that has expired, or that has fewer than 30
days left when a certificate must be issued, is an error naming its expiry date.

Nothing generated here is meant to be committed: ``.gitignore`` ignores every ``certs/``
directory (the repo's and each deployment's ``runs/<dir>/certs/``) and every ``*.key``,
``*.pem`` and ``*.crt``; ``tests/test_pki.py`` checks that and that no key is tracked.

The node keys are what SuperNode authentication (on by default in ``scripts/deploy.py`` and
``docker-compose.yml``) is based on: each public key is registered with the SuperLink
(``flwr supernode register keys/site-k.pub <conn> --name site-k``) before SuperNode ``k``
starts with ``--auth-supernode-private-key keys/site-k.key``.

Usage::

    python scripts/pki.py --out certs/ --supernodes 3 [--san my.host --san 10.0.0.5]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DEFAULT_SAN_DNS",
    "DEFAULT_SAN_IPS",
    "NodeKeyPair",
    "PkiFiles",
    "RuntimeCert",
    "cert_covers_host",
    "ensure_pki",
    "generate_node_keypair",
    "main",
    "node_key_name",
    "split_sans",
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


def split_sans(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split SAN entries into (DNS names, IP addresses), dropping duplicates.

    IP addresses may be bracketed (``[2001:db8::5]``); a port (``host:9092``) or anything else that is
    not a valid DNS name is a ``ValueError`` naming the entry.
    """
    dns: list[str] = []
    ips: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            raise ValueError("san: empty subjectAltName entry")
        bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
        try:
            ip = str(ipaddress.ip_address(bare))
        except ValueError:
            if bare != name:
                raise ValueError(f"san: {name!r}: only an IPv6 address may be written in brackets") from None
            if ":" in name:
                raise ValueError(
                    f"san: {name!r} is not a DNS name or IP address (a subjectAltName has no port: "
                    f"drop the ':PORT')"
                ) from None
            if not _valid_dns_name(name):
                raise ValueError(
                    f"san: {name!r} is neither an IP address nor a valid DNS name (labels of letters, "
                    f"digits and hyphens separated by dots, optionally starting with '*.')"
                ) from None
            if name.lower() not in (d.lower() for d in dns):
                dns.append(name)
        else:
            if ip not in ips:
                ips.append(ip)
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
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path}: expected an EC private key, got {type(key).__name__}")
    return key


def _ensure_private_mode(path: Path) -> None:
    if path.exists() and (path.stat().st_mode & 0o077):
        os.chmod(path, 0o600)


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


def _leaf_problem(
    cert_path: Path,
    key_path: Path,
    ca_cert: x509.Certificate,
    dns: Sequence[str],
    ips: Sequence[str],
) -> str | None:
    """Why the existing leaf certificate cannot be reused (``None``: it can).

    Reusable means: issued by this CA, matching its key, valid for at least
    ``_RENEW_MARGIN_DAYS`` more days, and its SANs cover ``dns`` and ``ips``.
    """
    if not (cert_path.exists() and key_path.exists()):
        return "missing"
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = _load_private_pem(key_path)
        cert.verify_directly_issued_by(ca_cert)
    except Exception:  # noqa: BLE001 - unreadable, foreign CA, bad signature: re-issue
        return "unreadable or not issued by this CA"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return f"does not match {key_path.name}"
    if cert.not_valid_after_utc - _now() < _dt.timedelta(days=_RENEW_MARGIN_DAYS):
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


def cert_covers_host(cert_path: str | os.PathLike[str], host: str) -> bool:
    """True when the certificate's subjectAltNames contain ``host`` (an IP or a DNS name;
    a ``*.example.org`` entry covers one leftmost label)."""
    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower().rstrip(".")
        for d in san.get_values_for_type(x509.DNSName):
            d = d.lower().rstrip(".")
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


def ensure_pki(
    out_dir: str | os.PathLike[str],
    num_supernodes: int = 0,
    extra_sans: Iterable[str] = (),
    *,
    force: bool = False,
    valid_days: int = 365,
    ca_common_name: str = "pgvi-flower-ca",
    runtime_certs: bool = True,
    log=None,
) -> PkiFiles:
    """Create (or reuse) the CA, SuperLink certificate and ``num_supernodes`` node keys.

    Parameters
    ----------
    out_dir:
        Output directory (created with mode 0700 if missing).
    num_supernodes:
        Number of SuperNode key pairs ``keys/site-0 .. keys/site-(n-1)``.
    extra_sans:
        Extra DNS names / IP addresses for the SuperLink certificate.
    force:
        Regenerate everything, including the CA and the node keys.
        Without it an existing ``ca.crt`` is always kept; if ``ca.key`` is absent (kept
        offline), only existing valid certificates are used and ``ValueError`` is raised
        when one would have to be issued. An expired CA, or one with fewer than 30 days
        left when a certificate must be issued, raises ``ValueError`` naming the date.
    runtime_certs:
        Also issue one Runtime API certificate per SuperNode (``runtime/site-k.pem``).
    valid_days:
        Validity of newly issued certificates.
    log:
        Optional ``callable(str)`` receiving one line per action.
    """
    if num_supernodes < 0:
        raise ValueError(f"num_supernodes must be >= 0, got {num_supernodes}")
    if valid_days < 1:
        raise ValueError(f"valid_days must be >= 1, got {valid_days}")
    say = log or (lambda _msg: None)
    out = Path(out_dir).expanduser().resolve()
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)
    keys_dir = out / "keys"
    keys_dir.mkdir(mode=0o700, exist_ok=True)

    dns, ips = split_sans([*DEFAULT_SAN_DNS, *DEFAULT_SAN_IPS, *extra_sans])

    ca_cert_p, ca_key_p = out / "ca.crt", out / "ca.key"
    srv_cert_p, srv_key_p = out / "server.pem", out / "server.key"

    # --- CA
    # ca.crt without ca.key: the operator moved the CA key offline (good practice). Never
    # create a new CA over it (that would break every distributed ca.crt): reuse what exists
    # and fail below if something must be issued.
    if not force and ca_key_p.exists() and not ca_cert_p.exists():
        raise ValueError(
            f"{ca_key_p} exists but {ca_cert_p} does not: restore ca.crt (or remove ca.key, or "
            "use --force to create a new CA and re-distribute ca.crt)"
        )
    new_ca = force or not ca_cert_p.exists()
    ca_key: ec.EllipticCurvePrivateKey | None
    if not new_ca:
        ca_cert = x509.load_pem_x509_certificate(ca_cert_p.read_bytes())
        if ca_key_p.exists():
            ca_key = _load_private_pem(ca_key_p)
            if ca_cert.public_key().public_numbers() != ca_key.public_key().public_numbers():
                raise ValueError(f"{ca_cert_p} does not match {ca_key_p}; use --force to regenerate")
            _ensure_private_mode(ca_key_p)
            say(f"reuse CA {ca_cert_p}")
        else:
            ca_key = None
            say(f"reuse CA {ca_cert_p} (no ca.key here: only existing certificates can be used)")
        ca_expiry = ca_cert.not_valid_after_utc
        if ca_expiry <= _now():
            raise ValueError(
                f"CA certificate {ca_cert_p} expired on {ca_expiry:%Y-%m-%d %H:%M} UTC: nothing it "
                "signed verifies any more; create a new CA with --force and re-distribute ca.crt"
            )
    else:
        ca_key, ca_cert = _make_ca(ca_common_name, valid_days=max(valid_days, 30))
        ca_expiry = ca_cert.not_valid_after_utc

    # --- which certificates must be (re-)issued: decided before anything is written
    renew = force or new_ca
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
                raise ValueError(
                    f"must issue {what}, but the CA private key {ca_key_p} is missing (only "
                    f"{ca_cert_p} is there): restore ca.key from where it is kept offline, or "
                    "provide the needed certificates, issued by this CA, in this directory"
                )
            if ca_expiry - _now() < _dt.timedelta(days=_CA_MIN_REMAINING_DAYS):
                raise ValueError(
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
                raise ValueError(
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
    parser.add_argument("--days", type=int, default=365, help="certificate validity in days")
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
            log=None if args.quiet else (lambda m: print(m, file=sys.stderr)),
        )
    except ValueError as err:
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
