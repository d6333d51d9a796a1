"""Hierarchical averaging: nodes average every window, all ranks every m windows (traced)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import assert_exact_coverage, run_scenario

from lightning_elche.comm.hierarchy import Levels, groups_of_nodes, node_groups

EVERY = 3


def test_node_groups_are_consecutive_ranks():
    assert node_groups(4, 2) == ([[0, 1], [2, 3]], 2)
    assert node_groups(6, 3) == ([[0, 1, 2], [3, 4, 5]], 2)
    with pytest.raises(ValueError, match="`ranks_per_node` must divide the world size 4"):
        node_groups(4, 3)


def test_nodes_given_rank_by_rank_group_the_ranks_of_each_machine():
    assert groups_of_nodes([0, 1, 0, 1], 4) == [[0, 2], [1, 3]]
    assert groups_of_nodes([7, 7, 3], 3) == [[0, 1], [2]]  # ids are labels, in the order of their first rank
    assert groups_of_nodes([5, 5], 2) == [[0, 1]]  # one node: make_averager then averages flat
    with pytest.raises(ValueError, match="`nodes` must list the node id of each of the 4 ranks"):
        groups_of_nodes([0, 1, 0], 4)
    with pytest.raises(ValueError, match="must be integers >= 0, got 'a'"):
        groups_of_nodes([0, "a"], 2)
    with pytest.raises(ValueError, match="must be integers >= 0, got True"):
        groups_of_nodes([0, True], 2)
    with pytest.raises(ValueError, match="`nodes` must list the node id"):
        groups_of_nodes("01", 2)


def test_levels_go_global_every_m_boundaries_and_at_a_consensus():
    levels = Levels(every=3)
    assert [levels.next(consensus=False) for _ in range(6)] == ["node", "node", "global"] * 2
    assert [levels.next(consensus) for consensus in (False, True, False, False)] == ["node", "global", "node", "node"]
    state = levels.state_dict()
    resumed = Levels(every=3)
    resumed.load(state)
    assert resumed.windows_since_global == levels.windows_since_global == 2


@pytest.fixture(scope="module")
def two_nodes_of_two(tmp_path_factory):
    """4 ranks as 2 'nodes' of 2 on this machine; rank 3 two times slower."""
    return run_scenario(
        tmp_path_factory.mktemp("hierarchy"), devices=4, epochs=2, samples=768, slow={"3": 2.0},
        elche={"anchor": 2, "max_anchor": 2, "node_sync_every": EVERY, "ranks_per_node": 2}, timeout=240,
    )


@pytest.mark.timeout(300)
def test_global_every_m_windows_node_level_between(two_nodes_of_two):
    results = two_nodes_of_two
    assert_exact_coverage(results, 768, 2)
    reference = results[0]["boundaries"]
    for result in results:
        assert [b["level"] for b in result["boundaries"]] == [b["level"] for b in reference]
    # the cadence: a global boundary after every m-1 node ones, and at the end of each epoch
    run = 0
    for index, boundary in enumerate(reference):
        last_of_epoch = index + 1 == len(reference) or reference[index + 1]["epoch"] != boundary["epoch"]
        run = 0 if boundary["level"] == "global" else run + 1
        assert run < EVERY, f"boundary {index}: {EVERY} node-level boundaries in a row"
        if last_of_epoch:
            assert boundary["level"] == "global", f"epoch {boundary['epoch']} ends without a global average"
    levels = [b["level"] for b in reference]
    assert levels.count("node") >= levels.count("global")
    # after a global boundary every rank holds the same parameters; after a node one, the node does
    for index, boundary in enumerate(reference):
        digests = [result["digests"][index] for result in results]
        if boundary["level"] == "global":
            assert len(set(digests)) == 1, f"boundary {index}"
        else:
            assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]


@pytest.mark.timeout(300)
def test_the_parameter_reduce_runs_on_the_node_group_or_on_all_ranks(two_nodes_of_two):
    """Traced: at node-level boundaries the big all-reduce goes over 2 ranks, at global ones over 4;
    the control data goes over all 4 at every boundary."""
    for result in two_nodes_of_two:
        boundaries = result["boundaries"]
        train = [c for c in result["calls"] if c["phase"] == "train" and c["origin"].startswith("elche:")]
        expected_at: dict[tuple[int, int], list[int]] = defaultdict(list)  # a batch may close two windows
        for (epoch, batch), boundary in zip(result["boundary_batches"], boundaries):
            expected_at[(epoch, batch)] += [4, 4] if boundary["level"] == "global" else [4, 2]
        for at, expected in expected_at.items():
            sizes = [c["group_size"] for c in train if (c["epoch"], c["batch"]) == at]
            assert sizes == expected, (at, sizes)
