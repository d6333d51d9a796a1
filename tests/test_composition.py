"""Every pair of ElChe's features, set together, on real processes (issue 32).

The features: an elastic cohort that loses a rank (``kill``) or admits one (``join``); dynamic and
planned dispatch; the policies sync, cadence and async; the outer optimizer; int8 compression;
streamed fragments; per-rank micro-batches; hierarchical averaging; LitData streaming and sharded
iterables. The policy, the dispatch and the data source are each one choice (a map-style dataset when
neither LitData nor shards). One pair is incoherent by nature and refused, with its reason
(:data:`INCOHERENT`; docs/compatibility.md): every other pair appears in at least one run of
:data:`RUNS`, a covering array whose first three runs switch every other feature on at once, and
:func:`test_the_runs_cover_every_pair` checks that.

Every run: every sample of every epoch trained once (a lost rank's last window aside: what it trained
up to its last boundary counts, as for elastic cohorts everywhere), every rank ending with the same
parameters, and no refusal. Elastic runs go through ``python -m lightning_elche.launch`` with two
launchers on this machine, each a node of two ranks for hierarchical averaging (a node is a launcher
in an elastic cohort); the others through Lightning's launcher, a node being two consecutive ranks.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from conftest import coverage_report, launch_two_nodes, load_results, run_scenario, write_litdata
from scenario_config import ScenarioConfig

from lightning_elche import ElCheStrategy

FEATURES = ("kill", "join", "dynamic", "planned", "sync", "cadence", "async", "outer", "int8", "fragments",
            "micro-batches", "hierarchy", "litdata", "shards")  # fmt: skip
ONE_CHOICE = (("sync", "cadence", "async"), ("dynamic", "planned"), ("litdata", "shards"))
INCOHERENT = {
    frozenset({"sync", "dynamic"}): (
        "policy='sync' averages after every step with equal shares, so a window's pool has nothing to claim: "
        "dispatch='dynamic' has no shares to follow",
        {"policy": "sync", "dispatch": "dynamic"},
        "no per-rank shares for policy='sync' to fix",
    ),
}

# Every run names its policy, dispatch and data source (None: a map-style dataset) and its other features.
EVERYTHING = ("kill", "join", "outer", "int8", "fragments", "micro-batches", "hierarchy")
RUNS = {
    "all-on-cadence-dynamic-litdata": ("cadence", "dynamic", "litdata", EVERYTHING),
    "all-on-async-planned-shards": ("async", "planned", "shards", EVERYTHING),
    "all-on-sync-planned-litdata": ("sync", "planned", "litdata", EVERYTHING),
    "cadence-planned-shards": ("cadence", "planned", "shards", ("outer", "hierarchy")),
    "async-dynamic-litdata": ("async", "dynamic", "litdata", ("int8", "micro-batches")),
    "cadence-dynamic-shards": ("cadence", "dynamic", "shards", ("fragments", "kill")),
    "sync-planned-shards": ("sync", "planned", "shards", ("int8", "hierarchy")),
}
SAMPLES, BATCH = 384, 8
LONG_ENOUGH_TO_JOIN = {"epochs": 3, "step_sleep_ms": 60}  # sleeping steps, not a wait: the joiner's start-up has the CPU


def features_of(run: tuple) -> set[str]:
    policy, dispatch, source, others = run
    return {policy, dispatch, *([source] if source else []), *others}


def test_the_runs_cover_every_pair() -> None:
    """Every pair of features that can be set together appears in a run; the incoherent one in none."""
    exclusive = {frozenset(pair) for group in ONE_CHOICE for pair in itertools.combinations(group, 2)}
    wanted = {frozenset(pair) for pair in itertools.combinations(FEATURES, 2)} - exclusive - set(INCOHERENT)
    covered = {frozenset(pair) for run in RUNS.values() for pair in itertools.combinations(sorted(features_of(run)), 2)}
    assert wanted - covered == set(), sorted(sorted(pair) for pair in wanted - covered)
    assert covered & set(INCOHERENT) == set()
    assert len(wanted) == 85  # 91 pairs of 14 features, less the 5 within a choice and the 1 incoherent


@pytest.mark.parametrize("pair", list(INCOHERENT), ids=lambda pair: "-".join(sorted(pair)))
def test_an_incoherent_pair_is_refused_saying_why(pair) -> None:
    _, settings, message = INCOHERENT[pair]
    with pytest.raises(ValueError, match=message):
        ElCheStrategy(**settings)


def scenario_config(out: Path, run: tuple, litdata_dir: str) -> dict:
    policy, dispatch, source, others = run
    features = set(others)
    elastic = bool(features & {"kill", "join"})
    elche: dict = {"policy": policy, "dispatch": dispatch, "timeout": 20}
    if policy != "sync":
        elche["anchor"] = 3
    if "int8" in features:
        elche["compression"] = "int8"
    if "fragments" in features:
        elche["fragments"] = 2
    if "hierarchy" in features:
        elche["node_sync_every"] = 2
        if not elastic:
            elche["ranks_per_node"] = 2
    devices = 2 if elastic or "hierarchy" not in features else 4  # elastic: two launchers of two ranks
    if "micro-batches" in features:  # the launch's ranks (member ids) 1 and 3 have less memory; joiners the loader's
        elche["micro_batch_sizes"] = [8, 4, 8, 2] if elastic or devices == 4 else [8, 4]
    if elastic:
        elche["elastic"] = True
    config: dict = {
        "out": str(out), "epochs": 2, "samples": SAMPLES, "batch_size": BATCH, "devices": devices, "elche": elche,
        "slow": {"1": 2.0}, "dataset": source or "map", "trainer": {"num_nodes": 2} if elastic else {},
    }  # fmt: skip
    if source == "litdata":
        config["litdata_dir"] = litdata_dir
    if "outer" in features:
        config["outer"] = {}
    if "kill" in features:
        config["kill_at"] = {"rank": 1, "epoch": 0, "batch": 3}
    if "join" in features:
        config.update(LONG_ENOUGH_TO_JOIN)
    return config


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory) -> str:
    """The scenario's items in LitData's chunk format, 64 per chunk."""
    return write_litdata(tmp_path_factory.mktemp("litdata") / "optimized", range(SAMPLES))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RUNS))
def test_features_compose(tmp_path, litdata_dir, name) -> None:
    run = RUNS[name]
    features = features_of(run)
    out = tmp_path / "out"
    config = ScenarioConfig.from_dict(scenario_config(out, run, litdata_dir))
    if features & {"kill", "join"}:
        finished, launched = launch_two_nodes(tmp_path, config, join="join" in features)
        stderr = "\n".join(proc.stderr for proc in finished)
        assert [proc.returncode for proc in finished] == [0] * len(finished), stderr[-6000:]
        members = launched - int("kill" in features)
        results = load_results(tmp_path, members, stderr)
    else:
        results = run_scenario(tmp_path, timeout=240, **scenario_config(out, run, litdata_dir))
    assert len({result["final_digest"] for result in results}) == 1, [r["final_digest"] for r in results]
    lost = []
    if "kill" in features:
        lost = [{"trained": json.loads((out / "member1_at_boundary.json").read_text())["trained"]}]
    for epoch in range(config.epochs):
        report = coverage_report([*results, *lost], SAMPLES, epoch)
        assert report["duplicates"] == [] and report["missing"] == [], (epoch, report)
    if "hierarchy" in features:
        levels = {boundary["level"] for boundary in results[0]["boundaries"]}
        assert {"node", "global"} <= levels, levels
