"""A worker of ``python -m lightning_elche.launch`` for tests/test_membership.py: no Lightning, just
the membership protocol. Every member all-reduces once in generation 0; the victim then dies
(SIGKILL); the survivors find out in their next all-reduce, read the heartbeats,
agree on generation 1 (the members whose heartbeat stopped are out) and all-reduce in its new process
group. A step voted on with the victim lost rolls back; voted on by the survivors, it commits.

    python -m lightning_elche.launch --nproc 3 tests/membership_app.py OUT VICTIM
    python -m lightning_elche.launch --nproc 2 --replace --spares 1 tests/membership_app.py OUT fail
    python -m lightning_elche.launch --nproc 1 --nnodes 2 --node-rank R ... tests/membership_app.py OUT outlive
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_elche.cohort.control import Generation
from lightning_elche.comm.membership import Heartbeat, Membership
from lightning_elche.comm.rendezvous import LAUNCHERS_ATTACHED, agent_store

TIMEOUT = timedelta(seconds=10)  # a kill is seen long before it
SURVIVORS = {victim: [member for member in range(3) if member != victim] for victim in range(3)}


def main(out: Path, victim: int) -> None:
    member = int(os.environ["ELCHE_MEMBER_ID"])
    store = agent_store()
    Heartbeat(store, member)
    membership = Membership(store, member, Generation.first(int(os.environ["WORLD_SIZE"])), TIMEOUT.total_seconds())
    membership.join_process_group("gloo", TIMEOUT)
    total = torch.ones(1)
    dist.all_reduce(total)
    if member == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    # No wait for the kill: the victim never enters this all-reduce, so it cannot complete whether it
    # starts before or after the victim's death; it fails once the victim's connections close.
    started = time.monotonic()
    try:
        dist.all_reduce(total)
        raise AssertionError("the all-reduce went through without the victim")
    except RuntimeError as error:
        failed = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    detected_s = time.monotonic() - started
    # The lowest survivor stands for a member whose part of a step completed: it votes, and must learn that
    # the step rolls back (the victim never voted); the other failed in the step, so it does not vote.
    completed_vote = membership.commit("between/0", TIMEOUT.total_seconds()) if member == min(SURVIVORS[victim]) else None
    generation = membership.agree(lost=membership.silent())
    membership.join_process_group("gloo", TIMEOUT)
    mine = torch.tensor([float(member)])
    dist.all_reduce(mine)
    survivors_vote = membership.commit("between/0", TIMEOUT.total_seconds())  # every member of generation 1 votes
    result = {
        "member": member, "failed": failed, "detected_s": detected_s, "recovered_s": time.monotonic() - started,
        "generation": generation.number, "members": list(generation.members), "rank": dist.get_rank(),
        "world_size": dist.get_world_size(), "sum_of_member_ids": mine.item(),
        "completed_vote": completed_vote, "survivors_vote": survivors_vote,
    }
    (out / f"member_{member}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def every_member_fails() -> None:
    """Every member exits with an error once the spare waits, member 0 marking the fit over first (as the
    strategy's teardown does after a failure too); the spare, still waiting for a place, sees that and
    exits with 0. The members count as trained, so that their launcher starts the spare."""
    member, store = int(os.environ["ELCHE_MEMBER_ID"]), agent_store()
    membership = Membership(store, member, None, TIMEOUT.total_seconds())
    if os.environ.get("ELCHE_SPARE") == "1":
        store.set("test/spare_waits", "1")
        sys.exit(3 if membership.wait_for_a_place() else 0)
    membership.note_training()
    store.wait(["test/spare_waits"])
    if member == 0:
        membership.finish()
    sys.exit(1)


def outlives_the_hosting_launcher() -> None:
    """Two launchers of one rank each. Member 0 (on the hosting launcher) exits once both launchers are
    attached; member 1 waits until the hosting launcher, its rank done, has detached from the store, and
    only then writes to it: the store must still be up."""
    member, store = int(os.environ["ELCHE_MEMBER_ID"]), agent_store()
    attached = 2 if member == 0 else 1
    while int(store.add(LAUNCHERS_ATTACHED, 0)) != attached:
        time.sleep(0.05)  # polls the store: the other launcher's attaching (member 0) or detaching ends it
    if member == 1:
        store.set("test/written_after_the_host_was_done", "1")


if __name__ == "__main__":
    if sys.argv[2] == "fail":
        every_member_fails()
    elif sys.argv[2] == "outlive":
        outlives_the_hosting_launcher()
    else:
        main(Path(sys.argv[1]), int(sys.argv[2]))
