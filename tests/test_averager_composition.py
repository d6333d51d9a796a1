"""Every averaging mode with every other, on real gloo ranks: sync or async, compressed or not, in
fragments or not, hierarchical or not (``comm/composed.py``).

One run of 4 ranks builds each combination in turn (the nodes given rank by rank, interleaved:
ranks 0 and 2 on one node, 1 and 3 on the other, or as consecutive pairs) and drives it through
eight windows of synthetic training with different steps per rank and per window (a rank that
took no step among them). At every boundary every rank gathers every rank's parameters before
and after and checks them against what the semantics say, computed here on its own from the
gathered numbers (:class:`Expected`): the exact work-weighted averages, at the node or the global
level, of the fragment due, at once or one window late with EASGD's alpha; within a codec's
tolerance where the parameters crossed compressed (the exact error-feedback identity is
``test_compression.py``'s). Every consensus boundary leaves the ranks bit-identical; the float
buffers are averaged exactly over the ranks that stepped, at every boundary; ``average_now``
(at window 5, with a background reduce in flight under async) makes every rank identical, the
exact average weighted by the window's steps; ``state_dict`` / ``load_state_dicts`` round-trips
exactly into a fresh averager. A second run of 2 ranks resumes each combination's 4 saved states:
the errors not yet sent are kept whole, the outer momentum too, and a consensus follows.

Failures are collected on every rank alike (the checks read the same gathered numbers), so no
rank stops early and leaves the others waiting; the parent asserts on them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from conftest import join_or_kill
from torch import nn

from lightning_elche import OuterNesterov
from lightning_elche.cohort.control import LocalReport
from lightning_elche.comm.averaging import FlatAverager, AveragingSpec, make_averager

WINDOWS = 8
CONSENSUS_AT = {3, WINDOWS - 1}
AVERAGE_NOW_AT = 5
ROUND_TRIP_AT = 4
NOT_FINITE_AT = 6  # rank 1's parameters hold a NaN: left out, the boundary a consensus
INTERLEAVED = [0, 1, 0, 1]  # rank -> node
# a codec's deviation from the exact average, as a share of the largest change it carried
# (two encodings per value, each rounding at most half a step of its block, plus the error fed back)
CODEC_TOLERANCE = {None: 0.0, "bf16": 0.03, "int8": 0.05, "fp8": 0.4}
EXACT_ATOL = 2e-6


@dataclass(frozen=True)
class Combo:
    policy: str = "cadence"
    compression: Optional[str] = None
    fragments: int = 1
    node_sync_every: int = 1
    nodes: Optional[list[int]] = None  # None: consecutive pairs (ranks_per_node=2)
    alpha: float = 1.0
    outer: bool = False

    @property
    def name(self) -> str:
        parts = [self.policy, str(self.compression), f"f{self.fragments}", f"m{self.node_sync_every}"]
        parts += [f"nodes{''.join(map(str, self.nodes))}" if self.nodes else "pairs", f"a{self.alpha}"]
        return "-".join(parts + (["outer"] if self.outer else []))


COMBOS = [
    Combo(),  # the flat averager: average_now and state on it too
    Combo(policy="async", alpha=0.5),
    Combo(node_sync_every=2, nodes=INTERLEAVED),
    Combo(policy="async", node_sync_every=2, nodes=INTERLEAVED),  # hierarchy + async
    Combo(policy="async", node_sync_every=3, alpha=0.5),
    Combo(compression="int8", node_sync_every=2, nodes=INTERLEAVED),  # compression + hierarchy
    Combo(compression="bf16", fragments=3, node_sync_every=3),
    Combo(fragments=3, node_sync_every=2, nodes=INTERLEAVED),  # fragments alone + hierarchy
    Combo(policy="async", compression="int8"),  # compression + async
    Combo(policy="async", compression="fp8", fragments=3, alpha=0.5),
    Combo(policy="async", fragments=3),  # fragments alone + async
    Combo(policy="async", compression="int8", fragments=3, node_sync_every=2, nodes=INTERLEAVED, alpha=0.5),
    Combo(policy="sync", compression="int8", fragments=3, outer=True),
    Combo(policy="async", compression="bf16", node_sync_every=2, outer=True),
    Combo(node_sync_every=2, nodes=INTERLEAVED, outer=True),
]
RESUMED = [combo for combo in COMBOS if combo.compression is not None or combo.outer]


def model() -> nn.Module:
    torch.manual_seed(0)  # every rank starts from the same parameters, as after Lightning's broadcast
    return nn.Sequential(nn.Linear(16, 12), nn.BatchNorm1d(12), nn.Linear(12, 16))


def averager_for(module: nn.Module, combo: Combo, rank: int, world: int, nodes: Optional[list[int]] = None) -> Any:
    return make_averager(
        module, rank=rank, world_size=world, device=torch.device("cpu"), group=None, spec=AveragingSpec(
            policy=combo.policy, outer=OuterNesterov(lr=0.7, momentum=0.9) if combo.outer else None,
            easgd_alpha=combo.alpha, node_sync_every=combo.node_sync_every, ranks_per_node=2,
            compression=combo.compression, fragments=combo.fragments, nodes=nodes if nodes is not None else combo.nodes,
            timeout=timedelta(seconds=60),
        ),
    )  # fmt: skip


def documented_copies(combo: Combo, world: int) -> float:
    """The memory docs/slow-links.md and comm/composed.py give each part, in copies of the parameters
    (the outer optimizer's two are its own, not the averager's)."""
    streamed, codec, fragments = combo.compression is not None or combo.fragments > 1, combo.compression, combo.fragments
    copies = 1.0 + (combo.policy == "async") + (streamed / fragments) + (streamed and combo.node_sync_every > 1)
    if codec is not None:
        value_bytes = 2.0 if codec == "bf16" else 1.016
        copies += 1 + 1 / world + 1 / (fragments * world) + value_bytes / (2 * fragments)
        if combo.policy == "async":
            copies += 1 / fragments + 1 / (fragments * world)
    return copies


def memory_model() -> nn.Module:
    """Large enough that padding chunks to whole codec blocks is lost in the count."""
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))


def steps_of(rank: int, window: int) -> int:
    return (rank + window) % 4  # 0 to 3, a rank with none in every window, never proportional across windows


@torch.no_grad()
def train(module: nn.Module, combo: int, window: int, rank: int, steps: int) -> None:
    """Each rank moves its own way, as far as it stepped; its BatchNorm statistics too."""
    generator = torch.Generator().manual_seed(10_000 * combo + 100 * window + rank)
    for param in module.parameters():
        param.add_(torch.randn(param.shape, generator=generator) * 0.01 * steps)
    norm = module[1]
    if steps:
        norm.running_mean.add_(torch.randn(12, generator=generator) * 0.1)
        norm.num_batches_tracked.add_(steps)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous())
    return torch.stack(out)


class Expected:
    """The semantics, from the gathered numbers: what each rank should hold after each boundary."""

    def __init__(self, combo: Combo, spans: list[tuple[int, int]], world: int) -> None:
        self.combo = combo
        self.spans = spans  # the cross-node reduce's fragments
        self.world = world
        nodes = combo.nodes or [r // 2 for r in range(world)]
        self.node_of = nodes
        self.hierarchical = combo.node_sync_every > 1
        self.since = [[0.0] * world for _ in spans]
        self.windows = 0
        self.turn = 0
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None  # launch, target, largest change
        self.nonfinite = [False] * world

    def average(self, thetas: torch.Tensor, weights: list[float], ranks: list[int], span: slice) -> torch.Tensor:
        counted = [r for r in ranks if weights[r] > 0]  # a rank left out may hold a NaN: 0 * NaN is NaN
        return sum(weights[r] * thetas[r, span] for r in counted) / sum(weights[r] for r in counted)

    def target(self, thetas: torch.Tensor, steps: list[int], level: str, crossed: list[int]) -> torch.Tensor:
        target = thetas.clone()
        if self.hierarchical and (level == "node" or len(crossed) < len(self.spans)):
            for node in set(self.node_of):
                ranks = [r for r in range(self.world) if self.node_of[r] == node]
                target[ranks] = self.average(thetas, [float(s) for s in steps], ranks, slice(None))
        for index in crossed:
            span = slice(*self.spans[index])
            weights = [0.0 if self.nonfinite[r] else w for r, w in enumerate(self.since[index])]
            target[:, span] = self.average(thetas, weights, list(range(self.world)), span)
            self.since[index] = [0.0] * self.world
        return target

    def boundary(
        self, thetas: torch.Tensor, steps: list[int], consensus: bool, nonfinite: list[bool]
    ) -> tuple[str, torch.Tensor, float]:
        """The level, the parameters every rank should hold after, and the largest change a codec carried."""
        self.nonfinite = nonfinite
        consensus = consensus or any(nonfinite)
        for since in self.since:
            for r, s in enumerate(steps):
                since[r] += s
        self.windows += 1
        level = "global" if consensus or self.windows >= self.combo.node_sync_every else "node"
        crossed: list[int] = []
        if level == "global":
            self.windows = 0
            if consensus or len(self.spans) == 1:
                crossed = list(range(len(self.spans)))
            else:
                crossed, self.turn = [self.turn], (self.turn + 1) % len(self.spans)
        change = 0.0
        if self.pending is not None:  # collected first, one window late
            launch, late, change = self.pending
            thetas = thetas + self.combo.alpha * (late - launch)
            self.pending = None
        target = self.target(thetas, steps, level, crossed)
        largest = float((thetas - target)[[not bad for bad in nonfinite]].abs().max())
        if self.combo.policy == "async" and not consensus:
            self.pending = (thetas, target, largest)
            return level, thetas, change
        return level, target, max(change, largest)

    def restart(self) -> None:
        self.since = [[0.0] * self.world for _ in self.spans]
        self.windows = 0
        self.pending = None


def _fail(failures: list[str], combo: Combo, window: int, what: str) -> None:
    failures.append(f"{combo.name}, window {window}: {what}")


def _check_buffers(failures: list[str], combo: Combo, window: int, before: torch.Tensor, after: torch.Tensor, moved: list[bool]) -> None:
    """Float buffers: the mean over the ranks that stepped, on every rank; the step count: rank 0's."""
    movers = [r for r, m in enumerate(moved) if m]
    mean = before[movers, :-1].mean(dim=0)
    if not all(torch.allclose(after[r, :-1], mean, rtol=0, atol=1e-6) for r in range(len(moved))):
        _fail(failures, combo, window, "float buffers are not the mean over the ranks that stepped")
    if not bool((after[:, -1] == before[0, -1]).all()):
        _fail(failures, combo, window, "integer buffers are not rank 0's")


def buffers_of(module: nn.Module) -> torch.Tensor:
    norm = module[1]
    return torch.cat([norm.running_mean, norm.running_var, norm.num_batches_tracked.view(1).float()])


def state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(state_equal, a, b))
    return bool(a == b)


def run_combo(index: int, combo: Combo, rank: int, world: int, out: Path, failures: list[str]) -> None:
    sized = memory_model()
    copies = averager_for(sized, combo, rank, world).nbytes / (4 * sum(p.numel() for p in sized.parameters()))
    if abs(copies - documented_copies(combo, world)) > 0.02 * documented_copies(combo, world):
        _fail(failures, combo, -1, f"holds {copies:.3f} copies of the parameters, the docs say {documented_copies(combo, world):.3f}")
    module = model()
    averager = averager_for(module, combo, rank, world)
    if (combo.policy, combo.compression, combo.fragments, combo.node_sync_every) == ("cadence", None, 1, 1):
        assert isinstance(averager, FlatAverager)
    cross = getattr(averager, "cross", None)  # the flat averager has none: its one fragment is every parameter
    fragments = cross.fragments if cross is not None else [averager.buffer.whole]
    expected = Expected(combo, [(f.start, f.end) for f in fragments], world)
    for window in range(WINDOWS):
        steps = steps_of(rank, window)
        train(module, index, window, rank, steps)
        nonfinite = [window == NOT_FINITE_AT and r == 1 for r in range(world)]
        if nonfinite[rank]:
            with torch.no_grad():
                next(module.parameters()).view(-1)[0] = float("nan")
        all_steps = [steps_of(r, window) for r in range(world)]
        report = LocalReport(steps=steps)
        thetas, buffers = gather(flat_params(module), world), gather(buffers_of(module), world)
        if window == AVERAGE_NOW_AT:
            errors = averager.state_dict().get("error")
            averager.average_now(report)
            expected.restart()
            if errors is not None and not torch.equal(averager.state_dict()["error"], errors):
                _fail(failures, combo, window, "a dropped reduce changed the error feedback")
            after = gather(flat_params(module), world)
            exact = sum(s * thetas[r] for r, s in enumerate(all_steps)) / sum(all_steps)
            if not all(torch.equal(after[r], after[0]) for r in range(world)):
                _fail(failures, combo, window, "average_now left the ranks different")
            if not torch.allclose(after[0], exact, rtol=0, atol=EXACT_ATOL):
                _fail(failures, combo, window, "average_now is not the exact average weighted by the window's steps")
            _check_buffers(failures, combo, window, buffers, gather(buffers_of(module), world), [s > 0 for s in all_steps])
            continue
        consensus = window in CONSENSUS_AT
        level, target, change = expected.boundary(thetas, all_steps, consensus, nonfinite)
        result = averager.exchange(report, needs_consensus=lambda control: consensus)
        after = gather(flat_params(module), world)
        consensus = consensus or any(nonfinite)
        if result.level != level:
            _fail(failures, combo, window, f"level {result.level}, expected {level}")
        tolerance = EXACT_ATOL + CODEC_TOLERANCE[combo.compression] * change
        if not combo.outer and not torch.allclose(after, target, rtol=0, atol=tolerance):
            worst = float((after - target).abs().max())
            _fail(failures, combo, window, f"parameters off the expected average by {worst:.3g} (tolerance {tolerance:.3g})")
        if consensus and not all(torch.equal(after[r], after[0]) for r in range(world)):
            _fail(failures, combo, window, "a consensus left the ranks different")
        if not bool(torch.isfinite(after).all()):
            _fail(failures, combo, window, "a rank that was not finite did not take the consensus")
        moved = [s > 0 and not bad for s, bad in zip(all_steps, nonfinite)]
        _check_buffers(failures, combo, window, buffers, gather(buffers_of(module), world), moved)
        if window == ROUND_TRIP_AT:
            states = [None] * world
            dist.all_gather_object(states, averager.state_dict())
            fresh = averager_for(model(), combo, rank, world)
            fresh.load_state_dicts(states)
            if not state_equal(fresh.state_dict(), averager.state_dict()):
                _fail(failures, combo, window, "state_dict -> load_state_dicts -> state_dict is not the same")
    if combo in RESUMED:
        torch.save(averager.state_dict(), out / f"{combo.name}.{rank}.pt")
    train(module, index, WINDOWS, rank, 1)
    thetas = gather(flat_params(module), world)
    averager.average_now(LocalReport(steps=0))  # nobody stepped: equal weights, still one model
    after = gather(flat_params(module), world)
    if not (all(torch.equal(after[r], after[0]) for r in range(world)) and torch.allclose(after[0], thetas.mean(dim=0))):
        _fail(failures, combo, WINDOWS, "average_now where nobody stepped is not the plain mean on every rank")


def resume_combo(combo: Combo, rank: int, world: int, out: Path, failures: list[str]) -> None:
    """4 saved ranks' states into 2: what was not sent is kept whole, the outer momentum too; a consensus follows."""
    saved = [torch.load(out / f"{combo.name}.{r}.pt", weights_only=True) for r in range(4)]
    module = model()
    averager = averager_for(module, combo, rank, world, nodes=[0, 1] if combo.nodes else None)
    averager.load_state_dicts(saved)
    state = averager.state_dict()
    if combo.compression is not None:
        owners = torch.zeros_like(saved[0]["error"])
        for s in saved:
            for start, values in s["owner_error"]:
                owners[start : start + values.numel()] += values
        total = gather(state["error"], world).sum(dim=0)
        if not torch.allclose(total, sum(s["error"] for s in saved) + world * owners, rtol=0, atol=1e-6):
            _fail(failures, combo, -1, "on 2 ranks the errors not yet sent are not those of the 4 saved ranks")
        if any(s for part in state["steps_since"] for s in part):
            _fail(failures, combo, -1, "on another world size the work counts did not restart")
    if combo.outer and rank == 0 and not torch.equal(state["outer"]["velocity"], saved[0]["outer"]["velocity"]):
        _fail(failures, combo, -1, "the outer momentum was not resumed")
    for window in range(2):
        train(module, 99, window, rank, 1 + rank)
        averager.exchange(LocalReport(steps=1 + rank), needs_consensus=lambda control, last=window == 1: last)
    after = gather(flat_params(module), world)
    if not torch.equal(after[0], after[1]):
        _fail(failures, combo, -1, "the resumed consensus left the ranks different")


def disagreeing_nodes(rank: int, world: int, failures: list[str]) -> None:
    """Ranks that were given different ``nodes`` would wait for each other's groups forever: refused on each."""
    try:
        averager_for(model(), Combo(node_sync_every=2), rank, world, nodes=[0, rank])
        failures.append("different `nodes` on the ranks were accepted")
    except ValueError as error:
        if "rank 0: [0, 0], rank 1: [0, 1]" not in str(error):
            failures.append(f"different `nodes` on the ranks: {error}")


def _rank_main(rank: int, world: int, store: str, out: str, phase: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the OpenMP pool the parent's checks started
    failures: list[str] = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        for index, combo in enumerate(COMBOS if phase == "compose" else RESUMED):
            if phase == "compose":
                run_combo(index, combo, rank, world, Path(out), failures)
            else:
                resume_combo(combo, rank, world, Path(out), failures)
        if phase == "resume":
            disagreeing_nodes(rank, world, failures)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        failures.append(traceback.format_exc())
    Path(out, f"{phase}.{rank}.json").write_text(json.dumps(failures))
    os._exit(0)


def run_ranks(tmp_path: Path, world: int, phase: str) -> list[list[str]]:
    context = multiprocessing.get_context("fork")
    store = tmp_path / f"store-{phase}"
    ranks = [context.Process(target=_rank_main, args=(r, world, str(store), str(tmp_path), phase)) for r in range(world)]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 150, what=f"{world} ranks, {phase}")
    return [json.loads((tmp_path / f"{phase}.{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.timeout(330)
def test_every_combination_averages_as_it_says_and_resumes(tmp_path):
    assert len({combo.name for combo in COMBOS}) == len(COMBOS)
    composed = run_ranks(tmp_path, 4, "compose")
    assert all(failures == composed[0] for failures in composed), composed  # every rank read the same numbers
    assert not composed[0], "\n".join(composed[0])
    resumed = run_ranks(tmp_path, 2, "resume")
    assert not resumed[0] and not resumed[1], "\n".join(resumed[0] + resumed[1])


def test_combos_cover_every_pair_of_modes():
    """Each new pair of modes is driven at least once: compression or fragments with hierarchy and with
    async, hierarchy with async, all three, and the outer optimizer with each."""
    def has(combo: Combo, *modes: str) -> bool:
        on = {
            "async": combo.policy == "async", "hierarchy": combo.node_sync_every > 1, "codec": combo.compression is not None,
            "fragments": combo.fragments > 1, "outer": combo.outer, "interleaved": combo.nodes is not None,
        }  # fmt: skip
        return all(on[mode] for mode in modes)

    pairs = [("codec", "hierarchy"), ("fragments", "hierarchy"), ("codec", "async"), ("fragments", "async"),
             ("hierarchy", "async"), ("outer", "async"), ("outer", "hierarchy"), ("outer", "codec"),
             ("interleaved", "async")]  # fmt: skip
    assert all(any(has(combo, *pair) for combo in COMBOS) for pair in pairs)
    assert any(has(combo, "codec", "fragments", "hierarchy", "async") for combo in COMBOS)
    assert {combo.compression for combo in COMBOS} == {None, "bf16", "int8", "fp8"}


def _survivor_main(rank: int, out: str) -> None:
    """3 ranks, async int8 in 2 fragments; rank 2 is lost as it launches a background reduce, which the
    others' threads then wait in. The survivors regroup as an elastic cohort would: each keeps its own
    state (no collective), joins a new group (the old one, and the reduce stuck in it, destroyed),
    builds the new generation's averager, loads the survivors' states and averages now."""
    torch.set_num_threads(1)
    failures: list[str] = []
    try:
        combo = Combo(policy="async", compression="int8", fragments=2)
        dist.init_process_group("gloo", init_method=f"file://{out}/store-3", rank=rank, world_size=3, timeout=timedelta(seconds=30))
        module = model()
        averager = averager_for(module, combo, rank, 3)
        for window in range(2):
            train(module, 0, window, rank, 1 + rank)
            if rank == 2 and window == 1:  # lost as it launches: the others' background stages wait for it
                averager.cross.lane.run = lambda work: os._exit(0)
            averager.exchange(LocalReport(steps=1 + rank), needs_consensus=lambda control: False)
        assert averager.overlap.in_flight
        train(module, 0, 2, rank, 1 + rank)
        mine = averager.state_dict()  # its own, no collective: the old group lost a rank
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{out}/store-2", rank=rank, world_size=2, timeout=timedelta(seconds=30))
        regrouped = averager_for(module, combo, rank, 2)
        states: list[Any] = [None, None]
        dist.all_gather_object(states, mine)
        regrouped.load_state_dicts(states)
        thetas = gather(flat_params(module), 2)
        regrouped.average_now(LocalReport(steps=1 + rank))
        after = gather(flat_params(module), 2)
        if not torch.equal(after[0], after[1]):
            failures.append("the survivors' average_now left them different")
        if not torch.allclose(after[0], (1 * thetas[0] + 2 * thetas[1]) / 3, rtol=0, atol=EXACT_ATOL):
            failures.append("the survivors' average_now is not their exact average weighted by their steps")
        owners = torch.zeros_like(states[0]["error"])
        for state in states:
            for start, values in state["owner_error"]:
                owners[start : start + values.numel()] += values
        kept = gather(regrouped.state_dict()["error"], 2).sum(dim=0)
        if not torch.allclose(kept, states[0]["error"] + states[1]["error"] + 2 * owners, rtol=0, atol=1e-6):
            failures.append("the survivors did not keep their own error feedback (and their owners')")
        train(module, 0, 3, rank, 1)
        regrouped.exchange(LocalReport(steps=1), needs_consensus=lambda control: False)
        regrouped.exchange(LocalReport(steps=1), needs_consensus=lambda control: True)
        after = gather(flat_params(module), 2)
        if not torch.equal(after[0], after[1]):
            failures.append("the regrouped cohort's next consensus left the survivors different")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        failures.append(traceback.format_exc())
    Path(out, f"survivor.{rank}.json").write_text(json.dumps(failures))
    os._exit(0)


@pytest.mark.timeout(120)
def test_survivors_of_a_lost_rank_regroup_and_average_now(tmp_path):
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_survivor_main, args=(r, str(tmp_path))) for r in range(3)]
    for process in ranks:
        process.start()
    join_or_kill(ranks, 90, what="3 ranks losing one with a background reduce in flight")
    for rank in (0, 1):
        failures = json.loads((tmp_path / f"survivor.{rank}.json").read_text())
        assert not failures, "\n".join(failures)
