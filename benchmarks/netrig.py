"""Hosts made of network namespaces on one machine, joined by a bridge, with real rate-limited links.

    with Rig(hosts=2, rate_mbit=100) as rig:
        server = rig.hosts[0].start([sys.executable, "train.py"])   # a process "on" host 0
        rig.hosts[1].link_down()                                     # partition host 1
        rig.hosts[1].link_up()

Each host is a namespace with one interface (``eth0``, address ``10.77.0.<i + 1>``) whose other end
sits on a Linux bridge in a namespace of its own (the switch); the link is rate-limited in both
directions by ``tc``'s token bucket filter (``tbf``). A process on a host also has the host's own
hostname (``host<i>``, in a UTS namespace of its own), which resolves to the host's address there
(``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` lays over ``/etc/hosts``), as on a real
machine: torchrun's c10d rendezvous tells the host that serves its store from that, and gloo picks its
interface from it. Traffic between hosts crosses the kernel's TCP
stack and the limiter, not loopback: the tests and benchmarks of multi-machine claims (torchrun over
two hosts, the elastic launcher with a partitioned host, hierarchical averaging, slow links) run on it.

Only addresses inside the namespaces made here are used, and every namespace is deleted on exit,
also when the body raises (deleting a namespace deletes the interfaces inside it). Needs root and
iproute2; :func:`unavailable` says why a rig cannot be made, so a test can skip with that reason.
Why not ``netem``: this kernel does not have it, so a rig has rate limits but no added latency.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Sequence

SUBNET = "10.77.0"  # each rig is its own network behind its own bridge: rigs side by side do not meet
INTERFACE = "eth0"
NETNS_ETC = Path("/etc/netns")  # files `ip netns exec NAME` lays over /etc for the processes it starts
BURST_MS = 1.0  # the limiter's bucket holds this long of the link's rate (see burst_for)
MIN_BURST_KB = 16
GOODPUT_PORT = 29413
# What tcp_mbit_s runs: a sink on host 0 that reads until the sender closes and answers one byte, and a
# source on host 1 that sends N bytes and prints the seconds from its first byte to that answer.
_SINK = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print('listening', flush=True)\n"
    "c, _ = s.accept()\n"
    "while c.recv(1 << 20): pass\n"
    "c.sendall(b'x')\n"
)
_SOURCE = (
    "import socket, sys, time\n"
    "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60); data = bytes(int(sys.argv[3]))\n"
    "started = time.perf_counter(); s.sendall(data); s.shutdown(socket.SHUT_WR); s.recv(1)\n"
    "print(time.perf_counter() - started, flush=True)\n"
)
_serial = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> Optional[str]:
    """Why a rig cannot be made here (not root, no iproute2), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = f"elche-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"ip netns add failed: {error.stderr.strip()}"
    _ip("netns", "delete", probe)
    return None


@dataclass
class Host:
    """One host of a rig: a namespace whose ``eth0`` reaches the others through the rig's bridge."""

    index: int
    namespace: str
    address: str
    switch_port: str  # the link's other end, on the bridge in the switch namespace
    switch: str

    @property
    def hostname(self) -> str:
        return f"host{self.index}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its network namespace, under its own hostname."""
        rename = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", rename, self.hostname, *argv]

    def environment(self, base: Optional[dict[str, str]] = None) -> dict[str, str]:
        """The environment a process on this host runs with: gloo picks its interface from the hostname
        unless ``GLOO_SOCKET_IFNAME`` names one, and the hostname is the machine's, not the host's."""
        return {**(os.environ if base is None else base), "GLOO_SOCKET_IFNAME": INTERFACE}

    def start(self, argv: Sequence[str], env: Optional[dict[str, str]] = None, **popen: Any) -> subprocess.Popen:
        """Start ``argv`` on this host, in a session of its own (so that its whole group can be killed)."""
        return subprocess.Popen(self.command(argv), env=self.environment(env), start_new_session=True, **popen)

    def sent_bytes(self, interface: str = INTERFACE) -> int:
        """Bytes this host has sent on ``interface`` since the rig was made: ``eth0`` (to other hosts,
        through the limiter) or ``lo`` (between its own processes, which a host's own address reaches too)."""
        listed = ["ip", "-n", self.namespace, "-s", "-j", "link", "show", "dev", interface]
        shown = subprocess.run(listed, check=True, capture_output=True, text=True).stdout
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])

    def link_down(self) -> None:
        """Partition this host: its link goes down, and a connection to or from it times out."""
        _ip("-n", self.namespace, "link", "set", "dev", INTERFACE, "down")

    def link_up(self, timeout_s: float = 10.0) -> None:
        """Heal the partition; returns once the link is operational again (a veth's carrier comes back
        a moment after the command)."""
        _ip("-n", self.namespace, "link", "set", "dev", INTERFACE, "up")
        deadline = time.monotonic() + timeout_s
        while "state UP" not in subprocess.run(
            ["ip", "-n", self.namespace, "link", "show", "dev", INTERFACE], capture_output=True, text=True
        ).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.namespace}'s {INTERFACE} not up {timeout_s:g} s after 'link set up'")
            time.sleep(0.01)  # the poll's interval: the link's state ends the wait


def burst_for(rate_mbit: float) -> int:
    """The limiter's bucket, in KB: what the link carries in ``BURST_MS`` at its rate, at least ``MIN_BURST_KB``.

    A token bucket lets a full bucket through at once, which a real link never does, so the smaller
    the better; but one smaller than what the rate delivers between two of the limiter's dequeues
    loses tokens and the link runs below its rate. Measured here, on a loaded two-core machine: at
    1000 Mbit/s a 64 KB bucket carried 500-560 Mbit/s of TCP, 128 KB 941 (of 957 that TCP's headers
    leave); at 100 Mbit/s 16 KB carried 95.2 (of 95.6)."""
    return max(MIN_BURST_KB, math.ceil(rate_mbit * 1e6 / 8 * BURST_MS / 1000 / 1024))


class Rig:
    """``hosts`` namespaces on a bridge, each link limited to ``rate_mbit`` (None: unlimited) both ways,
    through a bucket of ``burst_kb`` (default: :func:`burst_for` the rate).

    A context manager: the namespaces exist inside the ``with`` block and are deleted at its end."""

    def __init__(self, hosts: int, rate_mbit: Optional[float] = None, burst_kb: Optional[int] = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"a rig has 1 to 250 hosts, got {hosts}")
        self.hosts_count, self.rate_mbit = hosts, rate_mbit
        if burst_kb is None:
            burst_kb = 0 if rate_mbit is None else burst_for(rate_mbit)  # no limiter without a rate
        self.burst_kb = burst_kb
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []

    def __enter__(self) -> Rig:
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _build(self) -> None:
        tag = f"elche{os.getpid()}x{next(_serial)}"
        switch = f"{tag}-sw"
        self._add_namespace(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index in range(self.hosts_count):
            namespace, port = f"{tag}-h{index}", f"p{index}"
            self._add_namespace(namespace)
            # created in the switch namespace, so that names never clash with the machine's own interfaces
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", namespace)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            address = f"{SUBNET}.{index + 1}"
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
            host = Host(index, namespace, address, port, switch)
            if self.rate_mbit is not None:
                self._limit(namespace, INTERFACE)  # what the host sends
                self._limit(switch, port)  # what the host receives
            self.hosts.append(host)
        names = "".join(f"{host.address} {host.hostname}\n" for host in self.hosts)
        for host in self.hosts:
            folder = NETNS_ETC / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{names}")

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _limit(self, namespace: str, interface: str) -> None:
        subprocess.run(
            ["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
             "burst", f"{self.burst_kb}kb", "latency", "100ms"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def launch_ranks(self, argv: Sequence[str], port: int, env: Optional[dict[str, str]] = None,
                     stderr: Optional[Sequence[IO[str]]] = None, **popen: Any) -> list[subprocess.Popen]:
        """``argv`` on every host, one rank each, with the environment Lightning takes for ranks launched
        externally (as ``srun`` or a scheduler would): ``Trainer(num_nodes=<hosts>, devices=1)``, the
        rendezvous on host 0's ``port``; ``stderr``: a file per host for its rank's errors."""
        base = {**(os.environ if env is None else env), "MASTER_ADDR": self.hosts[0].address, "MASTER_PORT": str(port),
                "WORLD_SIZE": str(len(self.hosts)), "LOCAL_RANK": "0"}
        return [
            host.start(argv, env={**base, "NODE_RANK": str(host.index)}, stderr=None if stderr is None else stderr[index],
                       **popen)
            for index, host in enumerate(self.hosts)
        ]

    def tcp_mbit_s(self, nbytes: int = 25_000_000, timeout_s: float = 120.0) -> float:
        """The goodput of one TCP transfer of ``nbytes`` from host 1 to host 0, Mbit/s: what an application
        gets of the limited link (TCP/IP headers take 4.4 % of each full frame the limiter counts)."""
        sink = self.hosts[0].start([sys.executable, "-c", _SINK, self.hosts[0].address, str(GOODPUT_PORT)],
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
            source = [sys.executable, "-c", _SOURCE, self.hosts[0].address, str(GOODPUT_PORT), str(nbytes)]
            sent = subprocess.run(self.hosts[1].command(source), capture_output=True, text=True, timeout=timeout_s,
                                  check=True)
        finally:
            sink.kill()
            sink.wait()
        return nbytes * 8 / float(sent.stdout) / 1e6

    def teardown(self) -> None:
        """Delete every namespace this rig made (their interfaces go with them); safe to call twice."""
        while self._namespaces:
            namespace = self._namespaces.pop()
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        self.hosts = []
