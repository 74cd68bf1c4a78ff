"""scripts/pki.py review fixes (P1-P3, P5-P7).

- P1: a leaf whose notBefore is in the future is re-issued; a CA whose notBefore is in the future is refused.
- P2: ``ensure_pki`` holds an exclusive lock on ``<out>/.pki.lock``: concurrent runs make one consistent PKI.
  A filesystem without locks (``ENOLCK``) is an ``OSError`` naming the file it could not lock and saying to use
  a local filesystem (it was a bare ``[Errno 37] No locks available``); the CLI prints it on one line.
- P3: the CA has its own, longer lifetime (``--ca-days``, default 3650), so a leaf can be renewed by the same
  CA; ``--days`` at or below the renewal margin and a ``--ca-days`` too short for ``--days`` are refused.
- P5: SANs: IPv6 zone ids and unspecified addresses are refused, a trailing dot is dropped consistently, a
  "DNS name" of digits and dots (an IP typo) is refused.
- P6: unreadable or malformed files raise ``PkiError`` naming the file; the CLI prints one line, exit code 2.
- P7: a reused ``ca.crt`` that is not a CA certificate is refused.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from scripts import pki

REPO = Path(__file__).resolve().parents[1]
PKI_PY = str(REPO / "scripts" / "pki.py")
_REAL_NOW = pki._now


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _key(path: Path):
    return serialization.load_pem_private_key(path.read_bytes(), None)


@contextlib.contextmanager
def _clock(monkeypatch, delta: dt.timedelta):
    """pki's clock moved by ``delta`` (a host whose clock is ahead or behind, or a later run)."""
    with monkeypatch.context() as m:
        m.setattr(pki, "_now", lambda: _REAL_NOW() + delta)
        yield


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, PKI_PY, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def _reissue_server_cert(out: Path, monkeypatch, shift: dt.timedelta) -> None:
    """Replace server.pem with one signed by the CA in ``out`` as if issued at now + ``shift``."""
    dns, ips = pki.split_sans([*pki.DEFAULT_SAN_DNS, *pki.DEFAULT_SAN_IPS])
    with _clock(monkeypatch, shift):
        cert = pki._make_server_cert(_key(out / "ca.key"), _cert(out / "ca.crt"), _key(out / "server.key"),
                                     dns, ips, valid_days=300)  # fmt: skip
    (out / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


# ----------------------------------------------------------------------------- P1: validity window


def test_not_yet_valid_leaf_is_reissued(tmp_path, monkeypatch):
    out = tmp_path / "certs"
    pki.ensure_pki(out, 1)
    _reissue_server_cert(out, monkeypatch, dt.timedelta(days=30))
    future = (out / "server.pem").read_bytes()
    problem = pki._leaf_problem(out / "server.pem", out / "server.key", _cert(out / "ca.crt"), [], [])
    assert problem is not None and "not valid before" in problem

    msgs: list[str] = []
    pki.ensure_pki(out, 1, log=msgs.append)
    assert (out / "server.pem").read_bytes() != future
    assert any(m.startswith("new certificate") and "server.pem" in m for m in msgs), msgs
    srv = _cert(out / "server.pem")
    assert srv.not_valid_before_utc <= _REAL_NOW()
    srv.verify_directly_issued_by(_cert(out / "ca.crt"))


def test_ca_not_yet_valid_is_refused_naming_the_file(tmp_path, monkeypatch):
    out = tmp_path / "certs"
    with _clock(monkeypatch, dt.timedelta(days=2)):  # made on a host whose clock ran two days ahead
        pki.ensure_pki(out, 0)
    snap = (out / "ca.crt").read_bytes(), (out / "server.pem").read_bytes()
    with pytest.raises(pki.PkiError, match=re.escape(str(out / "ca.crt")) + r".*not valid before.*clock"):
        pki.ensure_pki(out, 0)
    assert ((out / "ca.crt").read_bytes(), (out / "server.pem").read_bytes()) == snap


def test_new_ca_keeps_its_clock_skew_margin(tmp_path):
    files = pki.ensure_pki(tmp_path / "certs", 0)
    assert _cert(files.ca_cert).not_valid_before_utc <= _REAL_NOW() - dt.timedelta(minutes=4)
    pki.ensure_pki(tmp_path / "certs", 0)  # reused at once: not "in the future"


# ----------------------------------------------------------------------------- P2: lock


def test_ensure_pki_waits_for_the_lock(tmp_path):
    out = tmp_path / "certs"
    out.mkdir(mode=0o700)
    fd = os.open(out / ".pki.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another pki.py run holds the directory
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pki.ensure_pki(out, 1)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert not done.wait(1.0), "ensure_pki ran while another run held <out>/.pki.lock"
        assert not (out / "ca.crt").exists()
    finally:
        os.close(fd)  # releases the lock
        t.join(60)
    assert done.is_set() and not errors, errors
    assert (out / "ca.crt").exists()


def _assert_consistent(out: Path, nodes: int) -> None:
    ca = _cert(out / "ca.crt")
    assert ca.public_key().public_numbers() == _key(out / "ca.key").public_key().public_numbers()
    leaves = [("server.pem", "server.key")] + [(f"runtime/site-{k}.pem", f"runtime/site-{k}.key") for k in range(nodes)]
    for cert, key in leaves:
        c = _cert(out / cert)
        c.verify_directly_issued_by(ca)
        assert c.public_key().public_numbers() == _key(out / key).public_key().public_numbers(), cert


def test_concurrent_runs_make_one_consistent_pki(tmp_path, monkeypatch):
    out = tmp_path / "certs"
    real_make_ca = pki._make_ca
    made: list[int] = []

    def slow_make_ca(*args, **kwargs):  # widen the window between "no CA here" and writing one
        made.append(1)
        time.sleep(0.5)
        return real_make_ca(*args, **kwargs)

    monkeypatch.setattr(pki, "_make_ca", slow_make_ca)
    errors: list[BaseException] = []
    logs: list[list[str]] = [[], []]

    def run(i: int) -> None:
        try:
            pki.ensure_pki(out, 2, log=logs[i].append)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(made) == 1, "both runs created a CA"
    assert sum(any(m.startswith("reuse CA") for m in log) for log in logs) == 1  # the second reused the first's
    _assert_consistent(out, 2)


def test_concurrent_cli_runs_succeed_with_one_pki(tmp_path):
    for trial in range(2):
        out = tmp_path / f"t{trial}"
        procs = [subprocess.Popen([sys.executable, PKI_PY, "--out", str(out), "-q", "--supernodes", "2"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            results = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in procs] == [0, 0], results
        _assert_consistent(out, 2)


def _no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_a_filesystem_without_locks_names_the_lock_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "certs"
    monkeypatch.setattr(pki.fcntl, "flock", _no_locks)
    with pytest.raises(OSError) as info:
        pki.ensure_pki(out, 1)
    assert info.value.errno == errno.ENOLCK  # still the OSError ensure_pki documents, with its errno
    text = str(info.value)
    assert str(out / pki.LOCK_NAME) in text and "No locks available" in text and "local filesystem" in text, text
    assert not (out / "ca.crt").exists()  # nothing written without the lock
    assert pki.main(["--out", str(out), "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pki.py: error: ") and str(out / pki.LOCK_NAME) in lines[0]


def test_a_read_only_directory_without_locks_names_the_directory(tmp_path, monkeypatch):
    out = tmp_path / "certs"
    pki.ensure_pki(out, 0)
    real_open = os.open

    def read_only(path, flags, *args):  # the lock file cannot be created: the run locks the directory itself
        if Path(path).name == pki.LOCK_NAME:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(pki.os, "open", read_only)
    monkeypatch.setattr(pki.fcntl, "flock", _no_locks)
    with pytest.raises(OSError, match=re.escape(f"cannot lock {out} (") + ".*local filesystem"):
        pki.ensure_pki(out, 0)


# ----------------------------------------------------------------------------- P3: CA lifetime


def test_ca_outlives_its_leaves_by_default(tmp_path):
    files = pki.ensure_pki(tmp_path / "certs", 1)
    now = _REAL_NOW()
    ca_left = _cert(files.ca_cert).not_valid_after_utc - now
    assert dt.timedelta(days=3649) < ca_left <= dt.timedelta(days=3650)
    assert _cert(files.server_cert).not_valid_after_utc - now <= dt.timedelta(days=365)


def test_default_renewal_keeps_the_ca(tmp_path, monkeypatch):
    """The 04 repro: 359 days later the leaf is within its renewal margin and must be re-issued by the same CA."""
    out = tmp_path / "certs"
    files = pki.ensure_pki(out, 1)
    ca = files.ca_cert.read_bytes()
    old_server = files.server_cert.read_bytes()
    with _clock(monkeypatch, dt.timedelta(days=359)):
        msgs: list[str] = []
        pki.ensure_pki(out, 1, log=msgs.append)
        assert not any("WARNING" in m for m in msgs), msgs
        assert files.ca_cert.read_bytes() == ca
        assert files.server_cert.read_bytes() != old_server
        srv = _cert(files.server_cert)
        srv.verify_directly_issued_by(_cert(files.ca_cert))
        assert srv.not_valid_after_utc - pki._now() > dt.timedelta(days=364)


def test_a_renewal_without_san_keeps_the_names_the_certificate_was_issued_for(tmp_path, monkeypatch):
    """docs/deploy.md's "Adding a node" (``--supernodes 4``, no ``--san``) near expiry re-issued server.pem with the
    default names only: remote SuperNodes dialling the public name failed their TLS check.  --force starts over."""
    out = tmp_path / "certs"
    files = pki.ensure_pki(out, 1, ["fl.example.org", "203.0.113.7"])
    old_server = files.server_cert.read_bytes()
    with _clock(monkeypatch, dt.timedelta(days=360)):
        msgs: list[str] = []
        pki.ensure_pki(out, 2, log=msgs.append)
        assert files.server_cert.read_bytes() != old_server  # renewed ...
        assert pki.cert_covers_host(files.server_cert, "fl.example.org")  # ... with its names
        assert pki.cert_covers_host(files.server_cert, "203.0.113.7")
        assert pki.cert_covers_host(files.server_cert, "superlink")
        assert any("keeps the names" in m and "fl.example.org" in m for m in msgs), msgs
        pki.ensure_pki(out, 2, force=True)
        assert not pki.cert_covers_host(files.server_cert, "fl.example.org")


@pytest.mark.parametrize("days", [0, 3, 7])
def test_days_at_or_below_the_renew_margin_are_refused(tmp_path, days):
    with pytest.raises(pki.PkiError, match=r"valid_days \(--days\).*7"):
        pki.ensure_pki(tmp_path / "certs", 0, valid_days=days)
    assert not (tmp_path / "certs").exists()


def test_ca_days_must_cover_days_and_both_margins(tmp_path):
    with pytest.raises(pki.PkiError, match=r"ca_valid_days \(--ca-days\).*402.*got 401"):
        pki.ensure_pki(tmp_path / "a", 0, valid_days=365, ca_valid_days=401)
    assert not (tmp_path / "a").exists()
    files = pki.ensure_pki(tmp_path / "b", 0, valid_days=30, ca_valid_days=67)
    left = _cert(files.ca_cert).not_valid_after_utc - _REAL_NOW()
    assert dt.timedelta(days=66) < left <= dt.timedelta(days=67)


def test_cli_days_and_ca_days(tmp_path):
    res = _cli("--out", str(tmp_path / "short"), "-q", "--days", "3")
    assert res.returncode == 2 and "--days" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "short").exists()
    res = _cli("--out", str(tmp_path / "ca"), "-q", "--days", "365", "--ca-days", "100")
    assert res.returncode == 2 and "--ca-days" in res.stderr and "Traceback" not in res.stderr, res.stderr
    for run in (1, 2):  # the 03 repro: a short leaf lifetime, run twice at once
        res = _cli("--out", str(tmp_path / "d30"), "-q", "--days", "30", "--ca-days", "500")
        assert res.returncode == 0, (run, res.stderr)
    left = _cert(tmp_path / "d30" / "ca.crt").not_valid_after_utc - _REAL_NOW()
    assert dt.timedelta(days=499) < left <= dt.timedelta(days=500)


# ----------------------------------------------------------------------------- P5: SANs


@pytest.mark.parametrize("bad", ["fe80::1%eth0", "[fe80::1%eth0]", "fe80::1%1"])
def test_ipv6_zone_id_is_refused(bad):
    with pytest.raises(ValueError, match=r"san: .*zone"):
        pki.split_sans([bad])


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "[::]", "0:0::0"])
def test_unspecified_address_is_refused(bad):
    with pytest.raises(ValueError, match=r"san: .*unspecified"):
        pki.split_sans([bad])


@pytest.mark.parametrize("bad", ["127.1", "10.0.0", "1.2.3.4.5", "192.168.001.1", "127.1."])
def test_digits_and_dots_are_not_a_dns_name(bad):
    with pytest.raises(ValueError, match=r"san: .*IP address"):
        pki.split_sans([bad])


def test_trailing_dot_is_dropped_once():
    assert pki.split_sans(["my.host.", "MY.host", "*.example.org."]) == (["my.host", "*.example.org"], [])
    with pytest.raises(ValueError, match="san: 'my.host..'"):
        pki.split_sans(["my.host.."])


def test_trailing_dot_and_zone_id_end_to_end(tmp_path):
    out = tmp_path / "certs"
    pki.ensure_pki(out, 0, ["my.host."])
    san = _cert(out / "server.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "my.host" in san.get_values_for_type(x509.DNSName)
    assert "my.host." not in san.get_values_for_type(x509.DNSName)
    msgs: list[str] = []
    pki.ensure_pki(out, 0, ["my.host"], log=msgs.append)  # same name: reused, not re-issued
    pki.ensure_pki(out, 0, ["my.host."], log=msgs.append)
    assert not any(m.startswith("new certificate") for m in msgs), msgs
    assert pki.cert_covers_host(out / "server.pem", "my.host")
    assert pki.cert_covers_host(out / "server.pem", "my.host.")
    assert not pki.cert_covers_host(out / "server.pem", "my.host..")

    with pytest.raises(ValueError, match="zone"):
        pki.ensure_pki(tmp_path / "zone", 0, ["fe80::1%eth0"])
    assert not (tmp_path / "zone" / "ca.key").exists()


# ----------------------------------------------------------------------------- P6: errors name the file


def test_pki_error_is_a_value_error():
    assert issubclass(pki.PkiError, ValueError)


@pytest.mark.parametrize("name", ["ca.crt", "ca.key"])
def test_corrupt_ca_file_error_names_it(tmp_path, name):
    out = tmp_path / "certs"
    pki.ensure_pki(out, 0)
    (out / name).write_text("garbage\n")
    with pytest.raises(pki.PkiError, match=re.escape(str(out / name))):
        pki.ensure_pki(out, 0)


def test_cert_covers_host_on_a_corrupt_file_names_it(tmp_path):
    bad = tmp_path / "server.pem"
    bad.write_text("garbage\n")
    with pytest.raises(pki.PkiError, match=re.escape(str(bad))):
        pki.cert_covers_host(bad, "localhost")


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("pki.py: error: ")
    return lines[0]


def test_cli_unreadable_file_is_one_clean_error(tmp_path):
    out = tmp_path / "certs"
    pki.ensure_pki(out, 0)
    (out / "ca.key").unlink()
    (out / "ca.key").mkdir()  # any OSError on read (as root, chmod 000 does not make a file unreadable)
    assert "ca.key" in _one_error_line(_cli("--out", str(out), "-q"))


def test_out_that_is_a_file_is_one_clean_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert str(f) in _one_error_line(_cli("--out", str(f), "-q"))
    with pytest.raises(pki.PkiError, match=re.escape(str(f)) + ".*not a directory"):
        pki.ensure_pki(f, 0)


# ----------------------------------------------------------------------------- P7: a CA must be a CA


def _write_ca(out: Path, *, ca: bool | None, key_cert_sign: bool | None) -> None:
    """ca.crt/ca.key with the given basicConstraints CA flag and keyUsage keyCertSign (None: no extension)."""
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "posing-ca")])
    now = _REAL_NOW()
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=3000))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )  # fmt: skip
    if ca is not None:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    if key_cert_sign is not None:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=key_cert_sign,
                          crl_sign=key_cert_sign, encipher_only=False, decipher_only=False),
            critical=True,
        )  # fmt: skip
    cert = builder.sign(key, hashes.SHA384())
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))  # fmt: skip


def test_a_leaf_posing_as_ca_is_refused(tmp_path):
    """The 16 repro: server.pem/server.key copied over ca.crt/ca.key."""
    src = pki.ensure_pki(tmp_path / "src", 0)
    out = tmp_path / "nonca"
    out.mkdir()
    (out / "ca.crt").write_bytes(src.server_cert.read_bytes())
    (out / "ca.key").write_bytes(src.server_key.read_bytes())
    with pytest.raises(pki.PkiError, match=re.escape(str(out / "ca.crt")) + r".*not a CA"):
        pki.ensure_pki(out, 0)
    assert not (out / "server.pem").exists()


@pytest.mark.parametrize(("ca", "key_cert_sign"), [(None, True), (False, True), (True, False)])
def test_a_certificate_that_cannot_sign_certificates_is_refused(tmp_path, ca, key_cert_sign):
    out = tmp_path / "certs"
    _write_ca(out, ca=ca, key_cert_sign=key_cert_sign)
    with pytest.raises(pki.PkiError, match=re.escape(str(out / "ca.crt")) + r".*not a CA"):
        pki.ensure_pki(out, 0)
    assert not (out / "server.pem").exists()


def test_a_ca_without_key_usage_is_still_a_ca(tmp_path):
    """keyUsage is optional (RFC 5280 4.2.1.3): basicConstraints CA:TRUE alone is a CA."""
    out = tmp_path / "certs"
    _write_ca(out, ca=True, key_cert_sign=None)
    files = pki.ensure_pki(out, 0)
    _cert(files.server_cert).verify_directly_issued_by(_cert(files.ca_cert))


@pytest.mark.parametrize("args", [["--supernodes", "4"], ["--supernodes", "3", "--san", "fl.example.org"],
                                  ["--supernodes", "3"]])
def test_keys_handed_to_the_container_uid_are_refused_not_replaced(tmp_path, monkeypatch, capsys, args):
    """Stop-30 review: after docs/deploy.md's `sudo chown 49999 <private keys>`, a re-run as the operator took the
    unreadable server.key for a damaged one and wrote a new key (owned by the operator: the SuperLink container
    could no longer read it), then stopped on the node keys. Now nothing is written and the error names the files.
    (The test runs as root, which reads every file: reading the handed keys is made to fail as it does for the
    operator, with EACCES.)"""
    certs = tmp_path / "certs"
    assert pki.main(["--out", str(certs), "--supernodes", "3", "-q"]) == 0
    handed = {certs / "server.key", *(certs / "keys").glob("site-*.key"), *(certs / "runtime").glob("*.key")}
    before = {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()}
    real_read = Path.read_bytes

    def read_bytes(self):
        if self in handed:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    capsys.readouterr()
    assert pki.main(["--out", str(certs), *args]) == 2
    err = capsys.readouterr().err
    assert "server.key" in err and "site-0.key" in err and "sudo" in err, err
    monkeypatch.setattr(Path, "read_bytes", real_read)
    after = {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing replaced
    assert pki.main(["--out", str(certs), *args, "-q"]) == 0  # the documented re-run with sudo (every file readable)
    assert (certs / "server.key").read_bytes() == before[certs / "server.key"]  # reused, not replaced
