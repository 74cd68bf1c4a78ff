"""docker-compose.yml / docker-compose.insecure.yml / Dockerfile, checked without a Docker engine.

1. ``docker compose config -q`` (Compose v2 >= 2.24, the engine is not needed) validates both
   the default file and the insecure override against the Compose specification; skipped
   with a reason when no Compose v2 binary is installed.
2. Structural checks in pure Python (PyYAML): services, images pinned to 1.39.0, every flag
   accepted by the installed flwr 1.39 ``flower-superlink/-supernode/-superexec --help`` and
   by their real argument parsers, certificate/key mounts read-only and matching the files
   ``scripts/pki.py`` writes, ports 9092 and 127.0.0.1:8000 published, no ``--insecure`` in the default file.
3. SuperNode authentication by default: the one-shot ``register-supernodes`` service registers
   every node's public key, every SuperNode starts only after it completed successfully, and its
   script (extracted from the compose file) is run for real against loopback TLS / plain-HTTP
   /health servers with a stand-in ``flwr`` CLI that records its calls.
"""

from __future__ import annotations

import fnmatch

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from scripts import pki

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
INSECURE = REPO / "docker-compose.insecure.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
FLWR_VERSION = "1.39.0"
NODES = (0, 1, 2)
#: one-shot setup services (no Flower daemon command)
ONE_SHOT = {"superlink-state-init", "register-supernodes"}
#: each node's warm compute worker (project image, `python -m client.warm_worker`, not a Flower daemon)
WORKERS = {f"compute-worker-{k}" for k in NODES}
WORKER_SOCKET = "/app/worker/worker.sock"
REGISTRAR = "register-supernodes"

BINARY_OF_ROLE = {
    "superlink": "flower-superlink",
    "supernode": "flower-supernode",
    "superexec": "flower-superexec",
}
#: rejected or deprecated in flwr 1.39 (notes §3, §7)
FORBIDDEN_FLAGS = {
    "--serverappio-api-address",
    "--clientappio-api-address",
    "--appio-api-address",
    "--plugin-type",
    "--control-api-address",
    "--auth-list-public-keys",
    "--auth-supernode-public-key",
}
PATH_FLAGS = {
    "--ssl-ca-certfile",
    "--ssl-certfile",
    "--ssl-keyfile",
    "--root-certificates",
    "--auth-supernode-private-key",
}
FLWR_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


# ----------------------------------------------------------------------------- loading


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that understands Compose's ``!override`` / ``!reset`` merge tags."""


def _tagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node):
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_multi_constructor("!", _tagged)


def _load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 - SafeLoader subclass


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _role(name: str) -> str:
    for role in ("superexec", "supernode", "superlink"):
        if name.startswith(role):
            return role
    raise AssertionError(f"unexpected service {name}")


def _flags(cmd: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in cmd if a.startswith("--")]


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _volumes(svc: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of every volume, short or long syntax."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            out.append((v["source"], v["target"], bool(v.get("read_only"))))
    return out


# ----------------------------------------------------------------------------- flwr help / parsers


@lru_cache(maxsize=None)
def _help_flags() -> dict[str, set[str]]:
    env = {**os.environ, **FLWR_ENV, "FLWR_HOME": str(Path("/tmp") / f"pgvi-help-{os.getpid()}")}
    bindir = Path(sys.executable).parent

    def run(binary: str) -> tuple[str, set[str]]:
        exe = bindir / binary if (bindir / binary).exists() else shutil.which(binary)
        assert exe, f"{binary} not installed"
        res = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        return binary, set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", res.stdout))

    with ThreadPoolExecutor(3) as pool:
        return dict(pool.map(run, BINARY_OF_ROLE.values()))


def _parser(role: str):
    if role == "superlink":
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink as make
    elif role == "supernode":
        from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode as make
    else:
        from flwr.supercore.cli.flower_superexec import _parse_args as make
    return make()


# ----------------------------------------------------------------------------- docker compose config


def _compose_binary() -> list[str] | None:
    """A Compose v2 (>= 2.24, for !override) command, or None."""
    candidates: list[list[str]] = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append([shutil.which("docker-compose")])  # type: ignore[list-item]
    for cmd in candidates:
        try:
            res = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.search(r"(\d+)\.(\d+)", res.stdout)
        if res.returncode == 0 and m and (int(m[1]), int(m[2])) >= (2, 24):
            return cmd
    return None


COMPOSE_CMD = _compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE_CMD is None,
    reason="no Docker Compose v2 >= 2.24 binary (`docker compose` plugin or `docker-compose`); "
    "see docs/deploy.md 'Validating the compose files'",
)


def _config(*files: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    assert COMPOSE_CMD is not None
    args = [*COMPOSE_CMD]
    for f in files:
        args += ["-f", str(f)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    return subprocess.run([*args, "config", "-q"], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


@needs_compose
def test_compose_config_default_is_valid():
    res = _config(COMPOSE)
    assert res.returncode == 0, res.stderr


@needs_compose
def test_compose_config_insecure_override_is_valid():
    res = _config(COMPOSE, INSECURE)
    assert res.returncode == 0, res.stderr


@needs_compose
def test_insecure_override_drops_key_registration_and_mounts_no_certificates():
    import json

    res = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "-f", str(INSECURE), "config", "--format", "json"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    assert REGISTRAR not in services  # only under the `secure` profile, which the override never enables
    for k in NODES:
        assert set(services[f"supernode-{k}"].get("depends_on", {})) == {"superlink"}
    for name, svc in services.items():
        mounts = [str(v.get("source", "")) for v in svc.get("volumes", [])]
        assert not any("certs" in m for m in mounts), (name, mounts)


@needs_compose
def test_compose_config_rejects_a_broken_file(tmp_path):
    """The validator can fail: an unknown service key and a bad restart policy are errors."""
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: flwr/superlink:1.39.0\n    restrat: always\n")
    assert _config(bad, cwd=tmp_path).returncode != 0
    bad.write_text("services:\n  x:\n    image: flwr/superlink:1.39.0\n    ports: [99999999]\n")
    assert _config(bad, cwd=tmp_path).returncode != 0


# ----------------------------------------------------------------------------- structure


def test_services_and_images_pinned(services):
    expected = {"superlink-state-init", "superlink", "superexec-serverapp", REGISTRAR}
    expected |= {f"supernode-{k}" for k in NODES} | {f"superexec-clientapp-{k}" for k in NODES} | WORKERS
    assert set(services) == expected
    for name, svc in services.items():
        image = svc["image"]
        if image.startswith("flwr/"):
            assert image.split(":", 1)[1] == FLWR_VERSION, (name, image)
    assert services["superlink"]["image"] == f"flwr/superlink:{FLWR_VERSION}"
    for k in NODES:
        assert services[f"supernode-{k}"]["image"] == f"flwr/supernode:{FLWR_VERSION}"
        assert services[f"superexec-clientapp-{k}"]["build"]["dockerfile"] == "Dockerfile"
    assert services["superexec-serverapp"]["build"]["dockerfile"] == "Dockerfile"
    project_images = {services[n]["image"] for n in services if n.startswith("superexec") or n in WORKERS}
    assert len(project_images) == 1 and FLWR_VERSION in project_images.pop()


def test_dockerfile_builds_from_superexec_1390_with_cpu_torch():
    text = DOCKERFILE.read_text()
    arg = re.search(r"^ARG FLWR_SUPEREXEC_IMAGE=(\S+)$", text, re.M)
    assert arg and arg[1].startswith(f"flwr/superexec:{FLWR_VERSION}")
    # pyproject pins Python 3.11, so the py3.11 variant of 1.39.0 must be the default base
    assert "py3.11" in arg[1]
    assert re.search(r"^FROM \$\{FLWR_SUPEREXEC_IMAGE\}$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["flower-superexec"\]$', text, re.M)
    assert "whl/cpu" in text and "--index-url" in text
    assert "simulation" not in re.sub(r"#.*", "", text)  # client/server only, no ray
    copies = re.findall(r"^COPY .*$", text, re.M)
    assert copies and not any("cert" in c or "key" in c for c in copies)


def test_dockerfile_brings_the_kernels_compiler_and_runs_as_flowers_user():
    """gcc and libc headers installed as root (the only root step), then back to Flower's user `app`; the kernels
    go to a private /app/kernels (the core loads kernels only from a directory nobody else can write)."""
    text = re.sub(r"#.*", "", DOCKERFILE.read_text())
    assert re.search(r'^ARG KERNEL_COMPILER="gcc libc6-dev"$', text, re.M)
    users = [(m.start(), m[1]) for m in re.finditer(r"^USER (\S+)$", text, re.M)]
    assert [u for _, u in users] == ["root", "app"]
    root_part = text[users[0][0]:users[1][0]]
    assert "apt-get install -y --no-install-recommends ${KERNEL_COMPILER}" in root_part
    assert "rm -rf /var/lib/apt/lists/*" in root_part
    assert "pip install" not in root_part and "COPY" not in root_part  # nothing else runs as root
    assert re.search(r"PGVI_KERNEL_CACHE=/app/kernels\b", text)
    assert re.search(r"chmod 700 [^\n]*/app/kernels", text)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker's build-context rules exclude ``path`` (relative, ``/``-separated): a pattern matches from the
    context's root, segment by segment (``*`` within one segment, ``**`` any number of them), and excludes the
    whole tree below a matching directory; a ``!`` pattern re-includes; the last matching pattern wins."""

    def match(pat: list[str], parts: list[str]) -> bool:
        if not pat:
            return True  # the pattern matched a parent directory: everything below it is excluded
        if pat[0] == "**":
            return any(match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and match(pat[1:], parts[1:])

    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if match(pattern.lstrip("!").strip("/").split("/"), path.split("/")):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_secrets_out_of_the_build_context():
    pats = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    # a key, certificate or state file at any depth of the packages the Dockerfile copies (``*.key`` alone matched
    # only at the context's root: a stray client/site-0.key went into the image)
    for secret in ("site-0.key", "client/site-0.key", "common/data/x.pem", "server/tls/server.crt", "strategies/certs/a",
                   "client/keys/k.pub", "runs/main/x", ".venv/bin/python", ".git/config", "client/state/s.npz"):
        assert _dockerignored(secret, pats), secret
    for kept in ("pyproject.toml", "client/app.py", "common/families.py", "server/app.py", "strategies/pgvi.py"):
        assert not _dockerignored(kept, pats), kept


def test_every_flag_is_accepted_by_installed_flwr(services):
    helps = _help_flags()
    for name, svc in services.items():
        if name in ONE_SHOT | WORKERS:
            continue
        cmd = [str(a) for a in svc["command"]]
        role = _role(name)
        accepted = helps[BINARY_OF_ROLE[role]]
        for flag in _flags(cmd):
            assert flag in accepted, f"{name}: {flag} not in `{BINARY_OF_ROLE[role]} --help`"
            assert flag not in FORBIDDEN_FLAGS, f"{name}: {flag} is rejected/deprecated in 1.39"
        # the real argparse parser of flwr 1.39 accepts the whole command (values, choices)
        ns = _parser(role).parse_args(cmd)
        if role in ("superlink", "supernode"):
            assert ns.isolation == "process"


def test_insecure_override_flags_accepted(services):
    helps = _help_flags()
    over = _load(INSECURE)["services"]
    assert set(over) <= set(services)
    for name, svc in over.items():
        if name == REGISTRAR:  # only disabled (moved to a profile) in the override
            assert svc == {"profiles": ["secure"]}
            continue
        cmd = [str(a) for a in svc["command"]]
        assert "--insecure" in cmd, name
        role = _role(name)
        assert set(_flags(cmd)) <= helps[BINARY_OF_ROLE[role]]
        _parser(role).parse_args(cmd)
        assert not any(f in cmd for f in PATH_FLAGS | {"--enable-supernode-auth"}), name
    assert "INSECURE" in INSECURE.read_text().split("services:")[0]


def test_no_insecure_in_default_file(services):
    assert "--insecure" not in COMPOSE.read_text()
    for name, svc in services.items():
        assert "--insecure" not in [str(a) for a in svc.get("command", [])], name


def test_tls_and_auth_wiring(services):
    link = [str(a) for a in services["superlink"]["command"]]
    assert {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth"} <= set(link)
    assert _arg(link, "--fleet-api-address") == "0.0.0.0:9092"
    assert _arg(link, "--port") == "8000" and _arg(link, "--host") == "0.0.0.0"
    assert _arg(link, "--database").startswith("state/")
    assert "--disable-runtime-dependency-installation" in link
    srv = [str(a) for a in services["superexec-serverapp"]["command"]]
    assert _arg(srv, "--runtime-api-address") == "superlink:8000" and "--root-certificates" in srv

    from flwr.common.config import parse_config_args

    for k in NODES:
        node = [str(a) for a in services[f"supernode-{k}"]["command"]]
        assert _arg(node, "--superlink") == "superlink:9092"
        assert {"--root-certificates", "--auth-supernode-private-key"} <= set(node)
        assert {"--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"} <= set(node)  # runtime API TLS
        assert _arg(node, "--port") == "9094"
        cfg = parse_config_args([_arg(node, "--node-config")])
        assert cfg == {"partition-id": k, "num-partitions": len(NODES), "client-id": f"site-{k}",
                       "state-dir": "/app/state", "compute-worker": WORKER_SOCKET}  # fmt: skip
        app = [str(a) for a in services[f"superexec-clientapp-{k}"]["command"]]
        assert _arg(app, "--runtime-api-address") == f"supernode-{k}:9094"
        assert "--root-certificates" in app
        # the ClientApp (in the SuperExec container) owns the state dir volume
        targets = {t: s for s, t, _ro in _volumes(services[f"superexec-clientapp-{k}"])}
        assert targets["/app/state"] == f"site-{k}-state"


def test_ports_published(services):
    ports = {str(p) for p in services["superlink"]["ports"]}
    # the Control API (no credentials in Flower 1.39) only on the host's loopback; the Fleet API everywhere
    assert {"9092:9092", "127.0.0.1:8000:8000"} <= ports
    assert not any(p.split(":")[-1] == "8000" and not p.startswith("127.0.0.1:") for p in ports), ports
    for name, svc in services.items():
        if name != "superlink":
            assert "ports" not in svc, f"{name} should not publish ports"


def test_cert_and_key_mounts_read_only_and_match_pki(services, tmp_path):
    files = pki.ensure_pki(tmp_path / "certs", len(NODES))
    generated = {p.relative_to(files.out_dir).as_posix() for p in files.out_dir.rglob("*") if p.is_file()}
    seen_sources = set()
    for name, svc in services.items():
        vols = _volumes(svc)
        by_target = {t: (s, ro) for s, t, ro in vols}
        for source, target, ro in vols:
            if source.startswith("./certs/"):
                assert ro, f"{name}: {source} must be mounted read-only"
                rel = source.removeprefix("./certs/")
                assert rel in generated, f"{name}: {source} is not a file scripts/pki.py writes"
                seen_sources.add(rel)
            if source.endswith((".key", ".pem", ".crt")):
                assert source.startswith("./certs/"), source
        # every certificate/key path in the command is a mounted file (WORKDIR /app)
        for i, arg in enumerate(svc.get("command", [])):
            if arg in PATH_FLAGS:
                path = str(svc["command"][i + 1])
                assert f"/app/{path}" in by_target, f"{name}: {arg} {path} not mounted"
                assert by_target[f"/app/{path}"][1], f"{name}: {path} not read-only"
    for k in NODES:  # each node gets its own auth key and runtime cert, nobody else's
        vols = {s for s, _t, _ro in _volumes(services[f"supernode-{k}"])}
        assert f"./certs/keys/site-{k}.key" in vols and f"./certs/runtime/site-{k}.key" in vols
        others = {f"./certs/keys/site-{j}.key" for j in NODES if j != k}
        assert not vols & others
    assert "server.key" in seen_sources and "ca.key" not in seen_sources  # the CA key stays home


def test_state_volumes_and_restart_policy(services, compose):
    assert {"superlink-state", "serverapp-outputs"} | {f"site-{k}-state" for k in NODES} <= set(compose["volumes"])
    assert {f"site-{k}-worker" for k in NODES} <= set(compose["volumes"])
    link_vols = {t: s for s, t, _ro in _volumes(services["superlink"])}
    assert link_vols["/app/state"] == "superlink-state"
    init = services["superlink-state-init"]
    assert init["entrypoint"][:3] == ["chown", "-R", "49999:49999"]
    assert services["superlink"]["depends_on"]["superlink-state-init"]["condition"] == "service_completed_successfully"
    for k in NODES:
        svc = services[f"supernode-{k}"]
        assert svc["restart"] == "on-failure"
        assert int(svc["environment"]["SUPERNODE_RESTART_DELAY_S"]) >= 60
        script = svc["entrypoint"][2]
        assert 'sleep "$${SUPERNODE_RESTART_DELAY_S}"' in script and 'flower-supernode "$$@" & child=$$!' in script
        assert svc["deploy"]["restart_policy"]["delay"] == "60s"


def test_each_node_has_its_own_warm_compute_worker(services):
    """compute-worker-k serves exactly node k: its socket is the node config's compute-worker path, on a volume
    shared only by worker-k and superexec-clientapp-k (the container whose ClientApps connect), and it writes the
    same state volume those ClientApps use. The command is parsed by the worker's own argument parser."""
    from flwr.common.config import parse_config_args

    from client.warm_worker import build_parser, key_path

    assert re.search(r"mkdir -p [^\n]*/app/worker", DOCKERFILE.read_text())  # volume initialised owned by `app`
    assert re.search(r"chmod 700 /app/worker", DOCKERFILE.read_text())  # ... and private: the worker checks it
    for k in NODES:
        worker = services[f"compute-worker-{k}"]
        assert worker["entrypoint"] == ["python", "-m", "client.warm_worker"]
        ns = build_parser().parse_args([str(a) for a in worker["command"]])
        assert ns.socket == WORKER_SOCKET and ns.torch_threads == 1
        node = [str(a) for a in services[f"supernode-{k}"]["command"]]
        cfg = parse_config_args([_arg(node, "--node-config")])
        assert cfg["compute-worker"] == ns.socket
        sock_dir = os.path.dirname(ns.socket)
        assert os.path.dirname(str(key_path(ns.socket))) == sock_dir  # the key file is on the shared volume too
        w_vols = {t: s for s, t, _ro in _volumes(worker)}
        app = services[f"superexec-clientapp-{k}"]
        a_vols = {t: s for s, t, _ro in _volumes(app)}
        assert w_vols[sock_dir] == a_vols[sock_dir] == f"site-{k}-worker"
        assert w_vols[cfg["state-dir"]] == a_vols[cfg["state-dir"]] == f"site-{k}-state"
        assert not any(ro for _s, _t, ro in _volumes(worker))  # it writes its socket, key and the client state
        for name, svc in services.items():
            if name not in (f"compute-worker-{k}", f"superexec-clientapp-{k}"):
                assert f"site-{k}-worker" not in {s for s, _t, _ro in _volumes(svc)}, name
        assert f"compute-worker-{k}" in app["depends_on"]
        assert worker["restart"] == "unless-stopped"
        assert "ports" not in worker


def test_insecure_override_keeps_the_warm_workers(services):
    from flwr.common.config import parse_config_args

    over = _load(INSECURE)["services"]
    for k in NODES:
        cfg = parse_config_args([_arg([str(a) for a in over[f"supernode-{k}"]["command"]], "--node-config")])
        assert cfg["compute-worker"] == WORKER_SOCKET
        vols = {t: s for s, t, _ro in _volumes(over[f"superexec-clientapp-{k}"])}
        assert vols == {"/app/state": f"site-{k}-state", "/app/worker": f"site-{k}-worker"}


def test_flower_env_everywhere(services):
    for name, svc in services.items():
        if name == "superlink-state-init":
            continue
        env = svc["environment"]
        for key, value in FLWR_ENV.items():
            assert str(env[key]) == value, (name, key)


def test_no_secrets_in_tracked_deploy_files():
    for path in (COMPOSE, INSECURE, DOCKERFILE, DOCKERIGNORE):
        text = path.read_text()
        assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, path


# ----------------------------------------------------------------------------- SuperNode registration


def _registrar_script(services) -> str:
    """The registrar's ``sh -c`` script as the container runs it (Compose turns ``$$`` into ``$``)."""
    entry = services[REGISTRAR]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"] and len(entry) == 3
    return entry[2].replace("$$", "$")


def test_supernodes_start_only_after_their_keys_are_registered(services):
    reg = services[REGISTRAR]
    assert reg["image"] == f"flwr/superlink:{FLWR_VERSION}"  # has the `flwr` CLI
    assert reg["restart"] == "no" and "superlink" in reg["depends_on"]
    assert reg["environment"]["SUPERNODES"].split() == [f"site-{k}" for k in NODES]
    assert reg["environment"]["SUPERLINK_CONTROL_API"] == "superlink:8000"
    for key, value in FLWR_ENV.items():
        assert str(reg["environment"][key]) == value
    vols = _volumes(reg)
    # only the CA certificate and the PUBLIC node keys, read-only; never a private key
    assert {(s, t) for s, t, _ro in vols} == {("./certs/ca.crt", "/app/certs/ca.crt")} | {
        (f"./certs/keys/site-{k}.pub", f"/app/keys/site-{k}.pub") for k in NODES
    }
    assert all(ro for _s, _t, ro in vols)
    script = _registrar_script(services)
    assert 'flwr supernode register "$pub" pgvi --name "$name" --format json' in script
    assert 'root-certificates = "$CA_CERT"' in script and "insecure" not in script.split("TOML")[1]
    for k in NODES:
        dep = services[f"supernode-{k}"]["depends_on"]
        assert dep == {REGISTRAR: {"condition": "service_completed_successfully"}}, dep
        # the node authenticates with ITS private key, whose public half the registrar registers
        node = [str(a) for a in services[f"supernode-{k}"]["command"]]
        by_target = {t: s for s, t, _ro in _volumes(services[f"supernode-{k}"])}
        assert by_target[f"/app/{_arg(node, '--auth-supernode-private-key')}"] == f"./certs/keys/site-{k}.key"


@needs_compose
def test_compose_config_resolves_registration_order():
    """`docker compose config` (the real Compose model) keeps the dependency chain."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    res = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config", "--format", "json"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    svc = json.loads(res.stdout)["services"]
    for k in NODES:
        dep = svc[f"supernode-{k}"]["depends_on"][REGISTRAR]
        assert dep["condition"] == "service_completed_successfully" and dep.get("required", True)
    assert "superlink" in svc[REGISTRAR]["depends_on"]
    assert svc[REGISTRAR]["entrypoint"][2].replace("$$", "$") == _registrar_script(_load(COMPOSE)["services"])


_FAKE_FLWR = """#!/bin/sh
# stand-in for the flwr CLI: records its arguments and the CLI config, answers like flwr 1.39
echo "$*" >> "$CALLS"
cp "$FLWR_HOME/config.toml" "$CALLS.config.toml"
case "$6" in
  site-1) echo 'Using SuperLink: pgvi'; echo '{"success": false, "error-message": "[code: 23] Public key already in use."}' ;;
  bad) echo '{"success": false, "error-message": "[code: 2] boom"}' ;;
  *) echo '{"success": true, "node-id": 4242}' ;;
esac
"""


def _health_server(tls_files: pki.PkiFiles | None):
    """A loopback HTTP(S) server whose /health answers 200 (TLS with the pki.py server cert)."""
    import http.server
    import ssl
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls_files is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls_files.server_cert, tls_files.server_key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _run_registrar(services, tmp_path, port: int, files: pki.PkiFiles, names: str, wait_s: int = 20):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "flwr").write_text(_FAKE_FLWR)
    (bindir / "flwr").chmod(0o755)
    (bindir / "python").symlink_to(sys.executable) if not (bindir / "python").exists() else None
    calls = tmp_path / "calls.txt"
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
           "SUPERLINK_CONTROL_API": f"127.0.0.1:{port}", "CA_CERT": str(files.ca_cert),
           "KEYS_DIR": str(files.out_dir / "keys"), "SUPERNODES": names, "WAIT_S": str(wait_s),
           "FLWR_HOME": str(tmp_path / "home")}  # fmt: skip
    res = subprocess.run(["/bin/sh", "-c", _registrar_script(services)], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return res, (calls.read_text().splitlines() if calls.exists() else [])


def test_registrar_script_registers_every_key_over_tls(services, tmp_path):
    files = pki.ensure_pki(tmp_path / "certs", len(NODES))
    srv = _health_server(files)
    try:
        port = srv.server_address[1]
        res, calls = _run_registrar(services, tmp_path, port, files, "site-0 site-1 site-2")
        assert res.returncode == 0, res.stderr
        keys = files.out_dir / "keys"
        assert calls == [f"supernode register {keys}/site-{k}.pub pgvi --name site-{k} --format json" for k in NODES]
        assert "registered site-0" in res.stdout and "4242" in res.stdout
        assert "site-1: public key already registered" in res.stdout  # idempotent re-`up`
        import tomllib

        conf = tomllib.loads((tmp_path / "calls.txt.config.toml").read_text())["superlink"]
        assert conf["pgvi"] == {"address": f"127.0.0.1:{port}", "root-certificates": str(files.ca_cert)}

        # a key file that is missing, or a registration the SuperLink refuses: exit 1 (nodes never start)
        res, _ = _run_registrar(services, tmp_path, port, files, "site-0 site-7")
        assert res.returncode == 1 and "site-7.pub missing" in res.stderr
        pki.generate_node_keypair(keys / "bad.key", keys / "bad.pub", "bad")
        res, _ = _run_registrar(services, tmp_path, port, files, "bad")
        assert res.returncode == 1 and "registering bad failed" in res.stderr
        # a CA that did not issue the server certificate: TLS fails, nothing is registered
        other = pki.ensure_pki(tmp_path / "other", 1)
        (tmp_path / "calls.txt").unlink()
        res, calls = _run_registrar(services, tmp_path, port, other, "site-0", wait_s=3)
        assert res.returncode == 1 and "not reachable over TLS" in res.stderr and calls == []
    finally:
        srv.shutdown()
        srv.server_close()


def test_registrar_script_skips_plain_http_superlink_with_warning(services, tmp_path):
    """The insecure override runs a plain-HTTP SuperLink without authentication: nothing to register."""
    files = pki.ensure_pki(tmp_path / "certs", 1)
    srv = _health_server(None)
    try:
        res, calls = _run_registrar(services, tmp_path, srv.server_address[1], files, "site-0")
    finally:
        srv.shutdown()
        srv.server_close()
    assert res.returncode == 0 and calls == []
    assert "WARNING" in res.stderr and "authentication is OFF" in res.stderr
