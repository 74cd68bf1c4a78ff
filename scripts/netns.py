"""A virtual LAN of network namespaces on this machine: a server host and one host per SuperNode.

Every host is a Linux network namespace with its own loopback. The server host, ``pgvi-<tag>-s``, holds a bridge
with the LAN's first address (``.1`` of its ``/24``); host ``k``, ``pgvi-<tag>-<k>``, has one interface, ``eth0``
at ``.k+2``, the far end of a veth pair whose near end is a port of that bridge. Nothing of the LAN is in the
caller's namespace, so what listens on it is reachable from the LAN's hosts only, never from this machine's own
network. The bridge's ports are isolated: a node's packets go to the server host, never to another node. A process
started with :meth:`VirtualLan.exec_prefix` (a node) or :meth:`VirtualLan.server_prefix` sees its host's
addresses only: a node reaches the server's LAN address and nothing else, not the server's loopback (where the
SuperLink's Control API stays), not another node, and nothing outside the LAN (no default route: a data set that
would be downloaded fails). Each SuperNode's Runtime API is on its own host's ``127.0.0.1``, so all use the same
port, as on real machines. :meth:`VirtualLan.in_server` runs a
Python function in the server host (a health check, a listening socket). :meth:`VirtualLan.set_link` takes a
node's cable out (a network partition: its sockets stay open and stop carrying packets, unlike a killed process)
and puts it back.

Creating one needs root (``CAP_NET_ADMIN``) and ``ip`` (iproute2). Used by ``scripts/deploy.py`` (``--netns``) and
``tests/test_deploy_netns.py``::

    with VirtualLan(3) as lan:   # makes the namespaces, the bridge and the veths; removes them at exit
        subprocess.run([*lan.exec_prefix(0), "python", "-c", "..."])   # runs on host 0 (lan.host_address(0))
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

NAME_PREFIX = "pgvi"
DEFAULT_SUBNET = "10.208.0.0/24"  # private to the LAN's namespaces: it cannot clash with this machine's networks
MAX_HOSTS = 250  # .2 .. .251 of a /24
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetnsError(RuntimeError):
    """A namespace, bridge or veth could not be made or removed (the message has ``ip``'s own words)."""


def _ip_bin() -> str:
    ip = shutil.which("ip")
    if ip is None:
        raise NetnsError("`ip` (iproute2) is not installed")
    return ip


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([_ip_bin(), *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_exists(name: str) -> bool:
    """Whether this namespace has an interface ``name``."""
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def unavailable_reason() -> str | None:
    """Why a :class:`VirtualLan` cannot be made here (not root, no ``ip``), or None. A kernel or container without
    network-namespace support is found only by trying: :meth:`VirtualLan.create` raises :class:`NetnsError`."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return None


class VirtualLan:
    """A server host and ``num_hosts`` node hosts, all network namespaces, on one bridge. :meth:`create` makes
    them, :meth:`destroy` removes them (also what a failed :meth:`create` had made); a context manager does both."""

    def __init__(self, num_hosts: int, *, tag: str | None = None, subnet: str = DEFAULT_SUBNET) -> None:
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {MAX_HOSTS}], got {num_hosts}")
        self.num_hosts = num_hosts
        self.tag = tag or secrets.token_hex(3)
        if not self.tag.isalnum() or len(self.tag) > 6:
            raise ValueError(f"tag must be at most 6 letters or digits (interface names have 15), got {self.tag!r}")
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.version != 4 or self.subnet.prefixlen != 24:
            raise ValueError(f"subnet must be an IPv4 /24, got {self.subnet}")
        self.created = False

    # names and addresses ---------------------------------------------------------------------------------------
    @property
    def server_namespace(self) -> str:
        return f"{NAME_PREFIX}-{self.tag}-s"

    def namespace(self, k: int) -> str:
        """Host ``k``'s network namespace."""
        self._check(k)
        return f"{NAME_PREFIX}-{self.tag}-{k}"

    @property
    def bridge(self) -> str:  # in the server host
        return f"{NAME_PREFIX}{self.tag}br"

    def _port(self, k: int) -> str:  # the veth end on the bridge, in the server host
        return f"{NAME_PREFIX}{self.tag}v{k}"

    def _peer(self, k: int) -> str:  # the end that becomes host k's eth0
        return f"{NAME_PREFIX}{self.tag}p{k}"

    @property
    def server_address(self) -> str:
        """The server host's address on the LAN (the bridge's)."""
        return str(self.subnet[1])

    def host_address(self, k: int) -> str:
        self._check(k)
        return str(self.subnet[k + 2])

    def hosts(self) -> Iterator[tuple[str, str]]:
        """(namespace, address) of every node host."""
        for k in range(self.num_hosts):
            yield self.namespace(k), self.host_address(k)

    def exec_prefix(self, k: int) -> list[str]:
        """Prepend to a command to run it on host ``k`` (``ip netns exec`` execs it: the PID is the command's)."""
        return [_ip_bin(), "netns", "exec", self.namespace(k)]

    def server_prefix(self) -> list[str]:
        """Prepend to a command to run it on the server host."""
        return [_ip_bin(), "netns", "exec", self.server_namespace]

    def _check(self, k: int) -> None:
        if not 0 <= k < self.num_hosts:
            raise ValueError(f"host index k must be in [0, {self.num_hosts}), got {k}")

    # life cycle ------------------------------------------------------------------------------------------------
    def create(self) -> VirtualLan:
        if self.created:
            raise NetnsError(f"LAN {self.tag} is already created")
        if os.geteuid() != 0:
            raise NetnsError("creating network namespaces needs root (CAP_NET_ADMIN)")
        taken = self.leftovers()
        if taken:  # another LAN with this tag: touch none of its parts (destroy() would remove them)
            raise NetnsError(f"LAN {self.tag} exists already here: {', '.join(taken)}")
        self.created = True  # from here on destroy() removes whatever exists
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def _build(self) -> None:
        srv, plen = self.server_namespace, self.subnet.prefixlen
        _ip("netns", "add", srv)
        _ip("-n", srv, "link", "set", "lo", "up")
        _ip("-n", srv, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", srv, "addr", "add", f"{self.server_address}/{plen}", "dev", self.bridge)
        _ip("-n", srv, "link", "set", self.bridge, "up")
        for k in range(self.num_hosts):
            ns, port, peer = self.namespace(k), self._port(k), self._peer(k)
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", peer)  # here for a moment, then moved
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", port, "netns", srv)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.host_address(k)}/{plen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", srv, "link", "set", port, "master", self.bridge)
            # an isolated port forwards to the bridge (the server) only, not to the other ports: nodes of different
            # owners do not share a network, they share a server
            _ip("-n", srv, "link", "set", "dev", port, "type", "bridge_slave", "isolated", "on")
            _ip("-n", srv, "link", "set", port, "up")

    def set_link(self, k: int, up: bool) -> None:
        """Connect (``up``) or disconnect host ``k``: its bridge port goes up or down. Its processes and sockets are
        untouched; while down, nothing it sends reaches the server and nothing reaches it."""
        self._check(k)
        _ip("-n", self.server_namespace, "link", "set", self._port(k), "up" if up else "down")

    def destroy(self) -> list[str]:
        """Remove the namespaces (the bridge and the veths go with them); returns what is still there afterwards
        (an empty list when all is gone). Safe to call twice. Stop the processes running on the hosts first: a
        namespace whose name is removed lives on, unreachable, as long as a process runs in it."""
        if not self.created:
            return []
        existing = set(namespaces())
        for ns in [*(self.namespace(k) for k in range(self.num_hosts)), self.server_namespace]:
            if ns in existing:
                _ip("netns", "del", ns, check=False)
        for k in range(self.num_hosts):  # a pair that failed to move out of this namespace
            for name in (self._port(k), self._peer(k)):
                if link_exists(name):
                    _ip("link", "del", name, check=False)
        left = self.leftovers()
        if not left:
            self.created = False
        return left

    def leftovers(self) -> list[str]:
        """The namespaces, and the interfaces in this namespace, that exist now under this LAN's names."""
        existing = set(namespaces())
        names = [self.server_namespace, *(self.namespace(k) for k in range(self.num_hosts))]
        left = [ns for ns in names if ns in existing]
        return left + [n for k in range(self.num_hosts) for n in (self._port(k), self._peer(k)) if link_exists(n)]

    def __enter__(self) -> VirtualLan:
        return self.create() if not self.created else self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # the server host from Python -------------------------------------------------------------------------------
    def in_server(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """``fn()`` run in a new thread that has joined the server host's network namespace (``setns``: the
        namespace is a thread's own), so that the sockets it makes are the server host's; they stay so when used
        from other threads. Its result, or its exception, is this call's."""
        box: dict[str, Any] = {}

        def enter_and_run() -> None:
            try:
                try:
                    fd = os.open(f"/run/netns/{self.server_namespace}", os.O_RDONLY)
                except OSError as err:
                    raise NetnsError(f"the server host {self.server_namespace} is not there: {err}") from None
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise NetnsError(f"setns into {self.server_namespace}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                box["value"] = fn()
            except BaseException as err:  # handed to the caller
                box["error"] = err

        thread = threading.Thread(target=enter_and_run, name=f"netns-{self.server_namespace}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise NetnsError(f"a call in {self.server_namespace} did not return within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # persistence (deploy.py's deployment.json) -----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"num_hosts": self.num_hosts, "tag": self.tag, "subnet": str(self.subnet), "created": self.created}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VirtualLan:
        lan = cls(int(data["num_hosts"]), tag=str(data["tag"]), subnet=str(data["subnet"]))
        lan.created = bool(data.get("created", False))
        return lan
