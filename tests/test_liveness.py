"""Liveness on a real TCPStore and gloo group: survivors name the rank that stopped answering.

The multi-process tests kill real processes (a rank, or the process hosting the store) because
that is the failure the module exists for: what matters is what a TCPStore client sees when its
peer or its server is gone, which no mock reproduces.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import join_or_kill, wait_until
from fake_clock import FakeClock

from lightning_elche.comm import liveness as liveness_module
from lightning_elche.comm.claims import TicketCounter
from lightning_elche.comm.rendezvous import launcher_store
from lightning_elche.comm.store import BoundedStore
from lightning_elche.comm.liveness import (
    ROLL_CALL_POLL_S, CohortFailure, FailurePlace, Liveness, StoreUnreachable, describe_failure, lost_ranks,
    naming_a_lost_store,
)

# The server stays up until the test kills it, or until the test's end closes its stdin (a test that
# failed before killing it leaves no server behind).
STORE_SERVER = (
    "import sys, datetime, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
    "timeout=datetime.timedelta(seconds=60))\n"
    "print(store.port, flush=True)\n"
    "sys.stdin.read()\n"
)


def _rank_main(rank: int, world_size: int, doomed: int, out: Path) -> None:
    """One rank: boundaries 0..4 with everyone, then `doomed` is SIGKILLed before boundary 5.

    Rank 0 hosts the store, as under Lightning's launcher, and stays up until the other
    survivors have read it."""
    port_file = out / "port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
        (out / "port.tmp").write_text(str(store.port))
        (out / "port.tmp").rename(port_file)
    else:
        wait_until(port_file.exists, f"rank {rank}: rank 0's store port written to {port_file}")
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=10))
    liveness = Liveness.from_default_group(rank, world_size)
    assert liveness is not None
    for boundary in range(5):
        liveness.reached(boundary)
    dist.barrier()
    if rank == doomed:
        os.kill(os.getpid(), signal.SIGKILL)
    liveness.reached(5)
    error: BaseException = RuntimeError("the all-reduce did not fail")
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as failure:  # gloo: connection reset by peer, or the group timeout
        error = failure
    started = time.monotonic()
    silent = liveness.silent(grace_s=3.0)
    last = liveness.last_boundaries()
    result = {
        "silent": silent,
        "last": {str(rank): boundary for rank, boundary in last.items()},
        "roll_call_s": time.monotonic() - started,
        "message": describe_failure(
        silent, last, FailurePlace(5, 1, 2, 40, "/ckpt/last.ckpt"), 10, error),
    }
    (out / f"{rank}.json").write_text(json.dumps(result))
    if rank == 0:  # the store's host: up until every other survivor has read the store and written its result
        others = [out / f"{r}.json" for r in range(world_size) if r not in (0, doomed)]
        wait_until(lambda: all(path.exists() for path in others), "rank 0: the other survivors' results")
    os._exit(0)  # no process-group teardown with a dead peer: it can block or abort


@pytest.mark.timeout(60)
def test_survivors_name_the_killed_rank_and_its_last_boundary(tmp_path):
    world_size, doomed = 3, 2
    # fork: the ranks start at once instead of importing torch and Lightning again (seconds each)
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_main, args=(rank, world_size, doomed, tmp_path)) for rank in range(world_size)]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 45, what="the three ranks of the roll call")
    assert [p.exitcode for p in ranks] == [0, 0, -signal.SIGKILL]
    for rank in range(world_size):
        if rank == doomed:
            continue
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        assert result["silent"] == [doomed]
        assert result["last"] == {"0": 5, "1": 5, "2": 4}
        # The grace waited out for the silent rank (a deadline on the monotonic clock: a loaded machine can only
        # lengthen it). No upper bound in seconds: the roll call cannot overrun it by more than a poll, and
        # past grace + STORE_ANSWER_S it would have raised StoreUnreachable instead of returning; how long a
        # poll takes is the machine's load (test_roll_call_names_the_ranks_that_never_answer counts its
        # waiting on a fake clock).
        assert result["roll_call_s"] >= 3.0, result
        message = result["message"]
        assert message.startswith("ElChe: rank 2 stopped answering at boundary 5 (epoch 1, window 2, step 40)")
        assert "(rank 2: the last boundary it reached was 4)" in message
        assert "Last consensus checkpoint: /ckpt/last.ckpt" in message
        assert "Process-group timeout: 10 s" in message
        assert "Underlying error: " in message and "did not fail" not in message


@pytest.fixture
def server_store() -> dist.TCPStore:
    """An in-process store: several Liveness objects on it stand for ranks that share it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_last_boundaries_with_none_for_never_recorded(server_store):
    ranks = [Liveness(server_store, rank, 3) for rank in range(3)]
    ranks[0].reached(4)
    ranks[1].reached(3)
    assert ranks[0].last_boundaries() == {0: 4, 1: 3, 2: None}
    ranks[2].reached(7)
    assert ranks[1].last_boundaries() == {0: 4, 1: 3, 2: 7}


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The liveness module's clock: time passes only in its own polls' sleeps."""
    fake = FakeClock()
    monkeypatch.setattr(liveness_module, "time", fake)
    return fake


def test_roll_call_names_the_ranks_that_never_answer(server_store, clock):
    ranks = [Liveness(server_store, rank, 3) for rank in range(3)]
    assert ranks[0].silent(grace_s=0.5) == [1, 2]
    # it polled until the grace was over, and not a poll longer
    assert 0.5 <= clock.now <= 0.5 + ROLL_CALL_POLL_S and set(clock.sleeps) == {ROLL_CALL_POLL_S}, clock.now
    waited = clock.now
    assert ranks[2].silent(grace_s=0.5) == [1]  # rank 0 has answered already
    assert 0.5 <= clock.now - waited <= 0.5 + ROLL_CALL_POLL_S
    waited = clock.now
    assert ranks[1].silent(grace_s=5.0) == []  # everyone answered: no waiting
    assert clock.now == waited


def test_keys_stay_under_their_prefix(server_store):
    """Two Liveness instances with different prefixes (two fits, two jobs) do not see each other."""
    Liveness(server_store, 0, 1, prefix="job_a").reached(9)
    assert Liveness(server_store, 0, 1, prefix="job_b").last_boundaries() == {0: None}
    assert Liveness(server_store, 0, 1, prefix="job_a").last_boundaries() == {0: 9}


def test_from_default_group_is_none_without_a_process_group():
    assert not dist.is_initialized()
    assert Liveness.from_default_group(0, 1) is None


def _serve_store() -> tuple[subprocess.Popen, int]:
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())
    server.stdout.close()  # nothing more is read; left open it is reported as an unclosed file
    return server, port


def _end(server: subprocess.Popen) -> None:
    server.kill()
    server.wait()
    assert server.stdin is not None
    server.stdin.close()


@pytest.mark.timeout(60)
def test_store_reads_fail_fast_when_the_store_server_was_killed(clock):
    """Rank 0 hosts the store under Lightning's launcher: when it dies, the survivors are told so."""
    server, port = _serve_store()
    try:
        liveness = Liveness(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), 1, 2)
        liveness.reached(3)
        server.kill()
        server.wait()
        with pytest.raises(StoreUnreachable) as unreachable:
            liveness.silent(grace_s=2.0)
        # the connection is closed: its own error at the first read, no poll waited and no read abandoned
        assert clock.sleeps == [] and str(unreachable.value).startswith("DistNetworkError"), unreachable.value
        with pytest.raises(StoreUnreachable):  # the broken connection is now known to the sender too
            liveness.reached(4)
    finally:
        _end(server)


@pytest.mark.timeout(60)
def test_a_launchers_store_whose_server_died_is_named_unreachable_at_once():
    """A launcher's connection broken (the hosting launcher exited, or a partition reset it) is the
    store lost, as a read that never answers is: the launcher stops its ranks and fails naming the store,
    not with a socket error's traceback; later reads refuse at once."""
    server, port = _serve_store()
    try:
        store = launcher_store("127.0.0.1", port)
        assert store.add("exits", 1) == 1
        server.kill()
        server.wait()
        with pytest.raises(StoreUnreachable) as lost:
            store.add("exits", 1)
        named = f"(the connection to the rendezvous store at 127.0.0.1:{port})"
        assert str(lost.value).startswith("DistNetworkError") and str(lost.value).endswith(named), lost.value
        with pytest.raises(StoreUnreachable, match="the connection to the rendezvous store"):
            store.set("exited/0", "1")
    finally:
        _end(server)


@pytest.mark.timeout(60)
def test_a_claim_after_the_store_host_died_says_so_and_names_the_checkpoint():
    """Dynamic dispatch claims from the store between boundaries; its host dying is named there too."""
    server, port = _serve_store()
    try:
        counter = TicketCounter(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), 2, answer_within_s=60)
        assert counter.claim(0, 1) == 2
        server.kill()
        server.wait()
        place = FailurePlace(
            boundary=4, epoch=1, window=2, cohort_step=40, last_checkpoint="/ckpt/last.ckpt",
            during="under dynamic dispatch", operation="claiming the next step from the rendezvous store",
        )  # fmt: skip
        with pytest.raises(CohortFailure) as failure, naming_a_lost_store(10, lambda: place):
            counter.claim(0, 1)
        message = str(failure.value)
        assert message.startswith(
            "ElChe: claiming the next step from the rendezvous store failed under dynamic dispatch, after boundary 3 "
            "(epoch 1, window 2, step 40) and the rendezvous store did not answer either (DistNetworkError"
        ), message  # the closed connection's own error, at once: not the store's 60 s timeout
        assert "Last consensus checkpoint: /ckpt/last.ckpt" in message
        with pytest.raises(ValueError), naming_a_lost_store(10, lambda: place):  # other errors pass unchanged
            raise ValueError("not the store")
    finally:
        _end(server)


@pytest.mark.timeout(60)
def test_store_reads_are_bounded_when_the_store_server_hangs():
    """A stopped (or partitioned) server never answers and TCPStore's check/get have no timeout:
    reads give up after their timeout, and later calls refuse at once instead of queueing behind it."""
    server, port = _serve_store()
    try:
        liveness = Liveness(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), 1, 2)
        liveness.reached(3)
        _stop(server)
        with pytest.raises(StoreUnreachable, match="no answer within 1 s"):  # the abandoned read, not an error
            liveness.last_boundaries(timeout_s=1.0)
        with pytest.raises(StoreUnreachable, match="still waiting"):  # refused before it writes to the store
            liveness.reached(4)
        server.kill()  # the abandoned read now sees the connection close and ends
        server.wait()
        assert "still waiting" not in _reason_once_unblocked(liveness)
    finally:
        _end(server)


@pytest.mark.timeout(60)
def test_a_claim_from_a_store_that_stopped_answering_gives_up_within_its_bound():
    """A rank cut off from the store by a partition while it claims: TCPStore's ``add`` has no timeout of
    its own (it waited for TCP to give up, a quarter of an hour: a partitioned host's rank hung in a claim),
    so a claim gives up after the fit's timeout, here 1 s, with the error that names the store."""
    server, port = _serve_store()
    try:
        counter = TicketCounter(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), 2,
                                answer_within_s=1.0)  # fmt: skip
        assert counter.claim(0, 1) == 2
        _stop(server)
        with pytest.raises(StoreUnreachable, match="did not answer within 1 s"):
            counter.claim(0, 1)
        with pytest.raises(StoreUnreachable):  # later claims refuse at once instead of queueing behind it
            counter.peek(0)
    finally:
        server.send_signal(signal.SIGCONT)
        _end(server)


def _stop(server: subprocess.Popen) -> None:
    """SIGSTOP the server and wait until it is stopped: the signal is delivered asynchronously, and a
    server still running for a moment on a loaded machine answers the read the test expects to hang."""
    server.send_signal(signal.SIGSTOP)
    stat = Path(f"/proc/{server.pid}/stat")
    wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "T", "the store server stopped by SIGSTOP", 10)


def _reason_once_unblocked(liveness: Liveness) -> str:
    """The StoreUnreachable reason once the abandoned read has ended (it ends inside the test)."""
    reasons: list[str] = []

    def unblocked() -> bool:
        with pytest.raises(StoreUnreachable) as caught:
            liveness.reached(5)
        reasons.append(str(caught.value))
        return "still waiting" not in reasons[-1]

    wait_until(unblocked, "the abandoned read ending once the killed server closed its connection", 10, 0.05)
    return reasons[-1]


def test_message_without_a_checkpoint_says_none_was_written_and_how_to_get_one():
    message = describe_failure(
        [1], {0: 0, 1: None}, FailurePlace(0, 0, 0, 0, None), 60, RuntimeError("Connection closed by peer\ntrace"))
    assert message.startswith("ElChe: rank 1 stopped answering at boundary 0")
    assert "it never reached a boundary" in message
    assert "No checkpoint was written yet" in message
    assert "ModelCheckpoint(every_n_train_steps=...)" in message and "OnExceptionCheckpoint" in message
    assert message.endswith("Underlying error: RuntimeError: Connection closed by peer")  # first line only


def test_message_names_every_silent_rank():
    message = describe_failure([1, 3], {1: 16, 3: None}, FailurePlace(17, 2, 3, 120, "/x/y.ckpt"), 60, RuntimeError("timeout"))
    assert message.startswith("ElChe: ranks 1, 3 stopped answering at boundary 17 (epoch 2, window 3, step 120)")
    assert "rank 1: the last boundary it reached was 16; rank 3: it never reached a boundary" in message
    assert "Last consensus checkpoint: /x/y.ckpt" in message


def test_message_when_the_store_is_unreachable_or_absent():
    unreachable = describe_failure(
        StoreUnreachable("no answer within 2 s"), {}, FailurePlace(17, 2, 3, 120, None), 60, RuntimeError("x"))
    assert "the rendezvous store did not answer either (no answer within 2 s)" in unreachable
    assert "rank 0 under Lightning's launcher" in unreachable
    # a partition looks the same from the cut-off side: the message names both causes
    assert "has died, or this machine is cut off from it by a network partition" in unreachable
    absent = describe_failure(
        None, {}, FailurePlace(17, 2, 3, 120, None), 60, RuntimeError("x"))
    assert "which rank stopped answering is unknown" in absent


def test_lost_ranks_are_the_silent_ones_behind_the_furthest_boundary():
    marks = {0: 5, 1: 4, 2: 5, 3: None}
    assert lost_ranks([1, 2], marks) == [1]  # rank 2 reached boundary 5: alive, waiting out its timeout
    assert lost_ranks([2, 3], marks) == [3]  # never reached any boundary
    assert lost_ranks([2], marks) == [2]  # nobody behind: the silent rank died after reaching the boundary
    assert lost_ranks([1], {}) == [1]


def test_message_when_the_store_left_after_the_roll_call():
    message = describe_failure(
        [1], {}, FailurePlace(5, 1, 0, 32, "/x/last.ckpt"), 20, RuntimeError("closed"))
    assert message.startswith("ElChe: rank 1 stopped answering at boundary 5")
    assert "rank 1: its last boundary is unknown (the store went away)" in message


def test_a_bounded_store_answers_while_its_server_does_and_gives_up_once_the_server_is_stopped():
    """TCPStore's add/check/get wait for a stopped server's reply without a timeout (a partitioned
    member's read did so past its fit's end); through a BoundedStore they give up after the bound,
    and every later read fails at once instead of queueing behind the one still waiting."""
    server, port = _serve_store()
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        store = BoundedStore(client, answer_within_s=10.0, what="the test's store")
        assert store.add("k", 2) == 2 and store.check(["k"]) and store.get("k") == b"2"
        store.set("s", "v")
        assert store.compare_set("s", "v", "w") == b"w"
        _stop(server)
        with pytest.raises(StoreUnreachable, match="the test's store did not answer within 10 s"):
            store.add("k", 1)
        with pytest.raises(StoreUnreachable, match="the test's store did not answer"):
            store.check(["k"])
    finally:
        server.kill()
        server.wait(30)
