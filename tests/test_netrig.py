"""The namespace rig (benchmarks/netrig.py) the multi-machine tests run on: hosts that reach each other
over the bridge and not otherwise, a partition that really cuts, a rate limit that really limits, and
nothing left behind.

Skipped, with the reason, where namespaces cannot be made (not root); `.ci/run` runs as root.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import wait_until

from benchmarks.netrig import Rig, burst_for, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no namespace rig here: {REASON}")

PORT = 29411
# A server that accepts one connection, reads until it closes and answers with the bytes it read.
SERVER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print('listening', flush=True)\n"
    "c, _ = s.accept(); n = 0\n"
    "while True:\n"
    "    b = c.recv(1 << 16)\n"
    "    if not b: break\n"
    "    n += len(b)\n"
    "print(n, flush=True)\n"
)
# A client that connects (with a timeout), sends N bytes and prints how long the transfer took.
CLIENT = (
    "import socket, sys, time\n"
    "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))\n"
    "started = time.monotonic(); s.sendall(bytes(int(sys.argv[3]))); s.shutdown(socket.SHUT_WR)\n"
    "s.settimeout(60); s.recv(1); print(time.monotonic() - started, flush=True)\n"
)


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def serve(host) -> subprocess.Popen:
    server = host.start([sys.executable, "-c", SERVER, host.address, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    return server


def send(host, to, nbytes: int, connect_timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    command = host.command([sys.executable, "-c", CLIENT, to.address, str(PORT), str(nbytes), str(connect_timeout_s)])
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_across_the_bridge_and_everything_is_deleted_at_the_end():
    before = namespaces()
    with Rig(hosts=3) as rig:
        made = namespaces() - before
        assert len(made) == 4, made  # three hosts and the switch
        assert [host.address for host in rig.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        server = serve(rig.hosts[0])
        try:
            counted = [(host.sent_bytes(), host.sent_bytes("lo")) for host in rig.hosts]
            sent = send(rig.hosts[2], rig.hosts[0], 100_000)
            assert sent.returncode == 0, sent.stderr
            assert server.communicate(timeout=30)[0].strip() == "100000"
            # the bytes went out of host 2's link, not its loopback, and host 1 sent nothing of them
            link = [host.sent_bytes() - was for host, (was, _) in zip(rig.hosts, counted)]
            loopback = [host.sent_bytes("lo") - was for host, (_, was) in zip(rig.hosts, counted)]
            assert link[2] >= 100_000 and loopback[2] < 10_000 and link[1] < 10_000, (link, loopback)
        finally:
            server.kill()
    assert namespaces() == before


@pytest.mark.timeout(120)
def test_a_host_whose_link_is_down_cannot_be_reached_until_it_is_up_again():
    with Rig(hosts=2) as rig:
        server = serve(rig.hosts[0])
        try:
            rig.hosts[0].link_down()
            cut = send(rig.hosts[1], rig.hosts[0], 10, connect_timeout_s=2.0)
            assert cut.returncode != 0 and ("timed out" in cut.stderr or "No route to host" in cut.stderr), cut.stderr
            rig.hosts[0].link_up()
            # host 1 may still hold the failed neighbour lookup for a moment: reachable again, within a deadline
            wait_until(lambda: send(rig.hosts[1], rig.hosts[0], 10).returncode == 0, "host 0 reachable again", 30, 0.2)
        finally:
            server.kill()


@pytest.mark.timeout(180)
def test_the_rate_limit_holds_the_transfer_to_at_most_the_rate():
    """2.5 MB over a 20 Mbit/s link takes at least 1 s (the limiter's burst aside): a lower bound, which
    a loaded machine can only make longer, so it holds whatever the load."""
    rate_mbit, nbytes = 20, 2_500_000
    with Rig(hosts=2, rate_mbit=rate_mbit) as rig:
        server = serve(rig.hosts[0])
        try:
            sent = send(rig.hosts[1], rig.hosts[0], nbytes)
            assert sent.returncode == 0, sent.stderr
        finally:
            server.kill()
    floor_s = (nbytes - 2 * rig.burst_kb * 1024) * 8 / (rate_mbit * 1e6)
    assert float(sent.stdout) >= 0.95 * floor_s, (sent.stdout, floor_s)


def test_a_rig_deletes_what_it_made_when_its_body_raises():
    before = namespaces()
    with pytest.raises(RuntimeError, match="the body failed"), Rig(hosts=2):
        assert len(namespaces() - before) == 3
        raise RuntimeError("the body failed")
    assert namespaces() == before


def test_the_limiters_bucket_holds_a_millisecond_of_the_rate_and_at_least_16_kb():
    assert burst_for(1000) == 123 and burst_for(100) == 16 and burst_for(10) == 16


def test_a_rig_of_no_hosts_is_refused():
    with pytest.raises(ValueError, match="1 to 250 hosts"):
        Rig(hosts=0)


def test_a_process_on_a_host_has_the_hosts_name_which_resolves_to_its_address():
    script = "import socket; name = socket.gethostname(); print(name, socket.gethostbyname(name))"
    with Rig(hosts=2) as rig:
        for host in rig.hosts:
            seen = subprocess.run(host.command([sys.executable, "-c", script]), capture_output=True, text=True, check=True)
            assert seen.stdout.split() == [host.hostname, host.address]
