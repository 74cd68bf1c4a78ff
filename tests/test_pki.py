"""scripts/pki.py: CA + SuperLink certificate + SuperNode OpenSSH keys."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from scripts import pki

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> pki.PkiFiles:
    out = tmp_path_factory.mktemp("pki") / "certs"
    return pki.ensure_pki(out, 3, ["pgvi.example.org", "10.1.2.3", "fd00::7"])


def _load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_server_cert_is_issued_by_ca(files):
    ca = _load_cert(files.ca_cert)
    srv = _load_cert(files.server_cert)
    srv.verify_directly_issued_by(ca)  # raises on a wrong issuer or a bad signature
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca is True
    assert srv.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = srv.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    # the server key really belongs to the certificate
    key = serialization.load_pem_private_key(files.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == srv.public_key().public_numbers()


def test_foreign_ca_does_not_verify(files, tmp_path):
    other = pki.ensure_pki(tmp_path / "other")
    with pytest.raises(Exception):
        _load_cert(files.server_cert).verify_directly_issued_by(_load_cert(other.ca_cert))


def test_sans_present(files):
    san = _load_cert(files.server_cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value
    dns = set(san.get_values_for_type(x509.DNSName))
    ips = set(san.get_values_for_type(x509.IPAddress))
    assert {"localhost", "superlink", "pgvi.example.org"} <= dns
    want_ips = {"127.0.0.1", "::1", "10.1.2.3", "fd00::7"}
    assert {ipaddress.ip_address(i) for i in want_ips} <= ips


def test_runtime_certs_per_node(files):
    ca = _load_cert(files.ca_cert)
    assert [r.name for r in files.runtime_certs] == ["site-0", "site-1", "site-2"]
    for k, rt in enumerate(files.runtime_certs):
        cert = _load_cert(rt.cert)
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) == {f"supernode-{k}", "localhost"}
        key = serialization.load_pem_private_key(rt.key.read_bytes(), None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()
        assert _mode(rt.key) == 0o600
    assert pki.ensure_pki(files.out_dir.parent / "nort", 2, runtime_certs=False).runtime_certs == ()


def test_node_keys_are_p384_openssh(files):
    assert [p.name for p in files.node_keys] == ["site-0", "site-1", "site-2"]
    seen = set()
    for pair in files.node_keys:
        text = pair.private_key.read_text()
        assert text.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        priv = serialization.load_ssh_private_key(text.encode(), password=None)
        pub_line = pair.public_key.read_text()
        assert pub_line.startswith("ecdsa-sha2-nistp384 ")
        assert pub_line.split()[-1] == pair.name
        pub = serialization.load_ssh_public_key(pub_line.encode())
        assert isinstance(priv, ec.EllipticCurvePrivateKey)
        assert isinstance(priv.curve, ec.SECP384R1)
        assert priv.public_key().public_numbers() == pub.public_numbers()
        seen.add(pub_line.split()[1])
    assert len(seen) == 3  # distinct keys


def test_flower_accepts_node_keys(files):
    """The exact loaders flwr 1.39 uses (`flwr supernode register`, `flower-supernode`)."""
    from flwr.cli.supernode.register import try_load_public_key

    for pair in files.node_keys:
        assert try_load_public_key(pair.public_key)  # raises on non-NIST / non-EC keys


def test_private_key_permissions(files):
    for path in [files.ca_key, files.server_key, *(p.private_key for p in files.node_keys)]:
        assert _mode(path) == 0o600, path
    for path in [files.ca_cert, files.server_cert, *(p.public_key for p in files.node_keys)]:
        assert _mode(path) == 0o644, path
    assert _mode(files.out_dir / "keys") == 0o700


def test_permissions_hold_under_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        f = pki.ensure_pki(tmp_path / "c", 1)
    finally:
        os.umask(old)
    assert _mode(f.ca_key) == _mode(f.server_key) == _mode(f.node_keys[0].private_key) == 0o600


def test_idempotent_and_force(tmp_path):
    out = tmp_path / "certs"
    first = pki.ensure_pki(out, 2)
    snap = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = pki.ensure_pki(out, 2)
    assert again == first
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snap

    # more nodes: old keys kept, new key added
    grown = pki.ensure_pki(out, 3)
    for pair in first.node_keys:
        assert pair.private_key.read_bytes() == snap[pair.private_key]
    assert grown.node_keys[2].private_key.exists()

    # a new SAN re-issues only the server certificate (same CA, same server key)
    pki.ensure_pki(out, 3, ["new.example.org"])
    assert first.ca_cert.read_bytes() == snap[first.ca_cert]
    assert first.server_key.read_bytes() == snap[first.server_key]
    assert first.server_cert.read_bytes() != snap[first.server_cert]
    san = _load_cert(first.server_cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value
    assert "new.example.org" in san.get_values_for_type(x509.DNSName)

    # a permanently reused private key whose mode was loosened gets tightened
    os.chmod(first.node_keys[0].private_key, 0o644)
    pki.ensure_pki(out, 3)
    assert _mode(first.node_keys[0].private_key) == 0o600

    forced = pki.ensure_pki(out, 3, force=True)
    assert forced.ca_cert.read_bytes() != snap[first.ca_cert]
    assert forced.node_keys[0].private_key.read_bytes() != snap[first.node_keys[0].private_key]
    _load_cert(forced.server_cert).verify_directly_issued_by(_load_cert(forced.ca_cert))


def test_corrupt_node_key_is_refused_not_overwritten(tmp_path):
    out = tmp_path / "certs"
    f = pki.ensure_pki(out, 1)
    f.node_keys[0].public_key.write_text("garbage\n")
    with pytest.raises(ValueError, match="site-0"):
        pki.ensure_pki(out, 1)


def _snapshot(out: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_offline_ca_key_reuses_valid_certs_and_never_replaces_the_ca(tmp_path):
    """ca.crt present, ca.key moved offline: reuse everything that is valid; never a new CA."""
    out = tmp_path / "certs"
    pki.ensure_pki(out, 2, ["edge.example.org"])
    offline = tmp_path / "vault-ca.key"
    (out / "ca.key").rename(offline)
    snap = _snapshot(out)

    again = pki.ensure_pki(out, 2, ["edge.example.org"])  # all leaves valid: nothing to do
    assert _snapshot(out) == snap and not (out / "ca.key").exists()
    assert again.ca_cert == out / "ca.crt"
    # node SSH keys need no CA: a third node's key pair is fine without runtime certificates
    grown = pki.ensure_pki(out, 3, ["edge.example.org"], runtime_certs=False)
    assert grown.node_keys[2].private_key.exists()
    assert (out / "ca.crt").read_bytes() == snap[out / "ca.crt"]

    # something must be issued (a new SAN; a new node's runtime certificate): clear error, no write
    snap = _snapshot(out)
    with pytest.raises(ValueError, match=r"server\.pem \(SAN lacks new\.example\.org\).*ca\.key is missing"):
        pki.ensure_pki(out, 3, ["new.example.org"])
    with pytest.raises(ValueError, match=r"runtime/site-2\.pem \(missing\).*restore ca\.key"):
        pki.ensure_pki(out, 3, ["edge.example.org"])
    assert _snapshot(out) == snap

    # the key restored: the missing certificates are issued by the SAME CA
    offline.rename(out / "ca.key")
    files = pki.ensure_pki(out, 3, ["new.example.org"])
    assert files.ca_cert.read_bytes() == snap[out / "ca.crt"]
    ca = _load_cert(files.ca_cert)
    _load_cert(files.server_cert).verify_directly_issued_by(ca)
    _load_cert(files.runtime_certs[2].cert).verify_directly_issued_by(ca)

    # CLI: exit 2 with the message, ca.crt untouched
    (out / "ca.key").unlink()
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "pki.py"), "--out", str(out), "--san", "x.example"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "ca.key" in res.stderr and "Traceback" not in res.stderr
    assert files.ca_cert.read_bytes() == snap[out / "ca.crt"]


def test_lone_ca_key_is_not_overwritten(tmp_path):
    out = tmp_path / "certs"
    pki.ensure_pki(out)
    (out / "ca.crt").unlink()
    key = (out / "ca.key").read_bytes()
    with pytest.raises(ValueError, match="restore ca.crt"):
        pki.ensure_pki(out)
    assert (out / "ca.key").read_bytes() == key


def _write_ca(out: Path, not_before, not_after) -> None:
    """A CA (cert + key) with the given validity window, as an older pki.py run might have left."""
    from cryptography.hazmat.primitives import hashes

    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "old-ca")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))  # fmt: skip


def test_expired_or_expiring_ca_is_a_clear_error(tmp_path):
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc)
    expired = tmp_path / "expired"
    _write_ca(expired, now - dt.timedelta(days=400), now - dt.timedelta(days=3))
    date = (now - dt.timedelta(days=3)).strftime("%Y-%m-%d")
    with pytest.raises(ValueError, match=f"expired on {date}.*--force"):
        pki.ensure_pki(expired, 1)
    # --force makes a new CA
    fresh = pki.ensure_pki(expired, 1, force=True)
    assert _load_cert(fresh.ca_cert).not_valid_after_utc > now + dt.timedelta(days=300)

    soon = tmp_path / "soon"
    _write_ca(soon, now - dt.timedelta(days=300), now + dt.timedelta(days=10))
    ca_bytes = (soon / "ca.crt").read_bytes()
    date = (now + dt.timedelta(days=10)).strftime("%Y-%m-%d")
    with pytest.raises(ValueError, match=f"expires on {date}.*less than 30 days"):
        pki.ensure_pki(soon, 1)
    assert (soon / "ca.crt").read_bytes() == ca_bytes and not (soon / "server.pem").exists()


def test_cert_covers_host(files):
    assert pki.cert_covers_host(files.server_cert, "127.0.0.1")
    assert pki.cert_covers_host(files.server_cert, "10.1.2.3")
    assert pki.cert_covers_host(files.server_cert, "PGVI.example.org")
    assert not pki.cert_covers_host(files.server_cert, "10.1.2.4")
    assert not pki.cert_covers_host(files.server_cert, "other.example.org")


def test_guards():
    with pytest.raises(ValueError, match="num_supernodes"):
        pki.ensure_pki("/nonexistent/never", -1)
    with pytest.raises(ValueError, match="valid_days"):
        pki.ensure_pki("/nonexistent/never", 0, valid_days=0)
    with pytest.raises(ValueError, match="san"):
        pki.split_sans(["bad name"])
    assert pki.split_sans(["a", "A", "::1", "0:0::1", "1.2.3.4"]) == (["a"], ["::1", "1.2.3.4"])


def test_tls_handshake_with_generated_certs(files):
    """A real TLS handshake on loopback: SAN 127.0.0.1 and 'localhost' verify against the CA."""
    srv_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    srv_ctx.load_cert_chain(files.server_cert, files.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        for _ in range(2):
            conn, _addr = listener.accept()
            try:
                with srv_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for name in ("127.0.0.1", "localhost"):
            cli_ctx = ssl.create_default_context(cafile=str(files.ca_cert))
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with cli_ctx.wrap_socket(raw, server_hostname=name) as tls:
                    assert tls.recv(2) == b"ok"
    finally:
        t.join(timeout=5)
        listener.close()
    assert not errors


def test_cli(tmp_path):
    out = tmp_path / "certs"
    cmd = [sys.executable, str(REPO / "scripts" / "pki.py"), "--out", str(out), "--supernodes", "2",
           "--san", "edge.local"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (out / "keys" / "site-1.key").exists() and (out / "server.pem").exists()
    res2 = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res2.returncode == 0 and "reuse CA" in res2.stderr
    bad = subprocess.run(cmd[:-1] + ["not a name"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "san" in bad.stderr


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


_needs_git = pytest.mark.skipif(
    not (REPO / ".git").exists() or _git("rev-parse", "--git-dir").returncode != 0,
    reason="not a git checkout",
)


@_needs_git
def test_generated_pki_is_git_ignored(tmp_path):
    """Everything pki.py writes (repo certs/, a deployment's runs/<dir>/certs/) is ignored by git."""
    files = pki.ensure_pki(tmp_path / "certs", 1)
    rel = sorted(p.relative_to(tmp_path).as_posix() for p in files.out_dir.rglob("*") if p.is_file())
    assert "certs/keys/site-0.key" in rel and "certs/ca.key" in rel
    candidates = rel + [f"runs/deploy/{r}" for r in rel] + ["somewhere/else/node.key", "x/server.pem"]
    res = _git("check-ignore", "--no-index", *candidates)
    assert sorted(res.stdout.split()) == sorted(candidates), res.stdout + res.stderr


_SECRET = re.compile(
    rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----\s*[A-Za-z0-9+/=]{40}"  # PEM / OpenSSH private key body
    rb"|-----BEGIN CERTIFICATE-----\s*[A-Za-z0-9+/=]{40}"
)


@_needs_git
def test_no_key_or_certificate_is_tracked():
    tracked = _git("ls-files", "-z").stdout.split("\0")
    tracked = [t for t in tracked if t]
    assert tracked
    bad_names = [t for t in tracked if re.search(r"\.(key|pem|crt|csr|p12|pfx)$|(^|/)certs/|(^|/)id_(rsa|ecdsa|ed25519)", t)]
    assert bad_names == []
    # no tracked file matches an ignore rule (a key force-added past .gitignore)
    assert _git("ls-files", "-ci", "--exclude-standard").stdout.strip() == ""
    leaks = []
    for t in tracked:
        path = REPO / t
        if path.is_file() and path.stat().st_size < 5_000_000:
            if _SECRET.search(path.read_bytes()):
                leaks.append(t)
    assert leaks == []
