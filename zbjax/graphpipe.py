"""GraphPipe's partitioner: cut an operator graph into a DAG of pipeline stages (no JAX needed).

The input is an abstract ``OpGraph`` (nodes with forward/backward costs and bytes, edges for
dataflow), so the search is testable without tracing anything; ``op_graph_from_jaxpr`` builds
one from a traced program.

**Series-parallel decomposition.** A connected set of nodes splits *in series* at a cut A | B
when every node of A reaches every node of B (every such cut is a prefix of any topological
order, so all of them are found in one pass); a disconnected set splits *in parallel* into its
weakly connected components. A connected set with no series cut is not series-parallel (an
"N": a -> c, b -> c, b -> d). ``non_series_parallel`` says what to do with it: ``"chain"``
(default) treats its nodes, in topological order, as a series of single nodes (valid stages,
but its inner parallelism is not used and the cost model over-estimates its depth);
``"merge"`` makes it one super-node (always in one stage); ``"error"`` raises PartitionError.

**Search space.** Each stage runs on its own device (at most ``num_devices`` stages). In a
series composition a stage is a run of consecutive children, or a child is cut on its own; a
parallel composition divides its devices among groups of branches, a group of several
branches being one stage; and the nodes right after a parallel composition (the fan-in, e.g.
a concat and a head) may join the last stage of one branch (its *carrier*) instead of taking a
device of their own.

**Objective.** With stage time t_s = forward + backward (B + W) of its nodes, a pipeline step
of m microbatches is estimated as ``P + (m - 1) * T``: P is the longest path through the stage
DAG weighted by t_s (one microbatch's trip) and T the largest t_s (the bottleneck that every
other microbatch waits for); for a chain of p equal stages this is 1F1B's (m + p - 1) t. A
stage keeps min(m, depth-to-sink) microbatches in flight under DAG 1F1B, so its device needs
``param_bytes + activation_bytes * min(m, depth_to_sink)``, which must stay within
``mem_limit``. Dynamic programming over (sub-graph, devices, depth of what follows, nodes
joined to its last stage) keeps, per pipeline depth, the Pareto set of (bottleneck, path,
devices, last-stage time); the best ``refine`` estimates are then simulated with dag-1f1b and
the fastest is returned.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from zbjax.errors import PartitionError
from zbjax.schedules.dag import dag_1f1b, dag_zb, depth_to_sink, topological_order
from zbjax.schedules.ir import Costs, Schedule, chain_edges, count, integer, real_number
from zbjax.schedules.simulate import simulate

#: At most this many branches of one parallel composition are grouped in every possible way;
#: wider ones only group consecutive branches (in order of decreasing cost).
MAX_GROUPED_BRANCHES = 6


@dataclass(frozen=True)
class OpNode:
    """One operator (or group of operators) of the model, for one microbatch.

    ``backward_cost`` is B + W; ``weight_cost`` is the W part (None: half of the backward).
    ``activation_bytes`` is what its forward keeps for the backward; ``param_bytes`` its weights.
    """

    name: str
    forward_cost: float
    backward_cost: float
    weight_cost: float | None = None
    activation_bytes: float = 0.0
    param_bytes: float = 0.0

    @property
    def w_cost(self) -> float:
        """Returns the W part of the backward (half of it when ``weight_cost`` is None)."""
        return self.backward_cost / 2 if self.weight_cost is None else self.weight_cost


_NODE_NUMBERS = ("forward_cost", "backward_cost", "weight_cost", "activation_bytes", "param_bytes")


def _node_index(value: Any, edge: Any) -> int:
    """Returns an edge end as an int (a Python or NumPy integer), else raises PartitionError:
    int() would truncate 0.5 to node 0, silently."""
    index = integer(value)
    if index is None:
        raise PartitionError(f"op graph edge {edge!r} names node {value!r}, not an integer")
    return index


@dataclass(frozen=True)
class OpGraph:
    """Operator nodes and dataflow edges (src, dst) between them; the edges form a DAG."""

    nodes: tuple[OpNode, ...]
    edges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        edges = {(_node_index(a, (a, b)), _node_index(b, (a, b))) for a, b in self.edges}
        object.__setattr__(self, "edges", tuple(sorted(edges)))
        n = len(self.nodes)
        if n == 0:
            raise PartitionError("the op graph has no nodes; give at least one OpNode")
        for node in self.nodes:
            if not isinstance(node, OpNode):
                raise PartitionError(
                    f"op graph node {node!r} is a {type(node).__name__}, not an OpNode; build "
                    "each node as OpNode(name, forward_cost, backward_cost, ...)"
                )
            for label in _NODE_NUMBERS:
                value = getattr(node, label)
                if value is None and label == "weight_cost":
                    continue
                number = real_number(value)  # Python, NumPy or 0-d array; not a bool
                if number is None or not math.isfinite(number):
                    raise PartitionError(
                        f"op node {node.name!r} has {label} = {value!r}; it must be a finite number"
                    )
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n) or a == b:
                raise PartitionError(
                    f"op graph edge ({a}, {b}) does not join two different nodes of 0..{n - 1}"
                )
        if len(topological_order(n, self.edges)) != n:
            raise PartitionError("the op graph's edges have a cycle; it must be a DAG")
        for node in self.nodes:
            costs = (node.forward_cost, node.backward_cost, node.w_cost)
            if min(costs) < 0 or node.w_cost > node.backward_cost:
                raise PartitionError(
                    f"op node {node.name!r} has costs {costs}; costs must be >= 0 and the W "
                    "part (weight_cost) at most backward_cost"
                )


@dataclass(frozen=True)
class GraphPartition:
    """Stages of an op graph: which stage each node is in, where each stage runs, the stage DAG.

    Stages are numbered in a topological order of ``edges`` (every edge goes from a lower to
    a higher stage). ``placement[s]`` is the device of stage s. ``predicted_step_time`` is
    the cost-model estimate (see the module docstring) and ``simulated_step_time`` the
    dag-1f1b makespan at the same costs.
    """

    stage_of_node: tuple[int, ...]
    placement: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]
    stage_names: tuple[str, ...]
    predicted_step_time: float
    num_microbatches: int
    forward: tuple[float, ...] = field(repr=False)
    backward_input: tuple[float, ...] = field(repr=False)
    backward_weight: tuple[float, ...] = field(repr=False)
    activation_bytes: tuple[float, ...] = field(repr=False)
    param_bytes: tuple[float, ...] = field(repr=False)
    simulated_step_time: float | None = None

    @property
    def num_stages(self) -> int:
        """Returns the number of stages."""
        return len(self.placement)

    @property
    def costs(self) -> Costs:
        """Returns the per-stage F, B and W times as schedule ``Costs``."""
        return Costs(self.forward, self.backward_input, self.backward_weight, 0.0)

    def depth(self) -> int:
        """Returns the number of stages on the longest path of the stage DAG."""
        return max(depth_to_sink(self.num_stages, self.edges))

    def stage_memory(self, num_microbatches: int | None = None) -> tuple[float, ...]:
        """Returns each stage's bytes under dag-1f1b: params + activations in flight."""
        m = (
            self.num_microbatches
            if num_microbatches is None
            else count("num_microbatches", num_microbatches, PartitionError)
        )
        depth = depth_to_sink(self.num_stages, self.edges)
        return tuple(
            self.param_bytes[s] + self.activation_bytes[s] * min(m, depth[s])
            for s in range(self.num_stages)
        )


# ------------------------------------------------------------------ series-parallel structure


@dataclass(frozen=True)
class SPTree:
    """A series-parallel decomposition: ``kind`` is "leaf" (``nodes`` stay in one piece),
    "series" (children run one after another) or "parallel" (children are independent)."""

    kind: str
    nodes: tuple[int, ...]
    children: tuple[SPTree, ...] = ()


def series_parallel_tree(graph: OpGraph, non_series_parallel: str = "chain") -> SPTree:
    """Returns the series-parallel decomposition of ``graph`` (see the module docstring)."""
    if non_series_parallel not in ("chain", "merge", "error"):
        raise PartitionError(
            f"non_series_parallel = {non_series_parallel!r}; use 'chain', 'merge' or 'error'"
        )
    n = len(graph.nodes)
    order = topological_order(n, graph.edges)
    rank = {v: k for k, v in enumerate(order)}
    successors = [[] for _ in range(n)]
    neighbours = [[] for _ in range(n)]
    for a, b in graph.edges:
        successors[a].append(b)
        neighbours[a].append(b)
        neighbours[b].append(a)
    # Bit masks of the nodes each node reaches (itself excluded).
    reach = [0] * n
    for v in reversed(order):
        for q in successors[v]:
            reach[v] |= reach[q] | (1 << q)

    def components(nodes: tuple[int, ...]) -> list[tuple[int, ...]]:
        inside, seen, found = set(nodes), set(), []
        for start in nodes:
            if start in seen:
                continue
            stack, part = [start], []
            seen.add(start)
            while stack:
                v = stack.pop()
                part.append(v)
                for q in neighbours[v]:
                    if q in inside and q not in seen:
                        seen.add(q)
                        stack.append(q)
            found.append(tuple(sorted(part, key=rank.__getitem__)))
        return found

    def decompose(nodes: tuple[int, ...]) -> SPTree:
        if len(nodes) == 1:
            return SPTree("leaf", nodes)
        parts = components(nodes)
        if len(parts) > 1:
            return SPTree("parallel", nodes, tuple(decompose(p) for p in parts))
        rest = sum(1 << v for v in nodes)
        common = -1
        cuts = []
        for k, v in enumerate(nodes[:-1]):
            common &= reach[v]
            rest &= ~(1 << v)
            if rest & ~common == 0:
                cuts.append(k + 1)
        if not cuts:
            if non_series_parallel == "error":
                names = [graph.nodes[v].name for v in nodes]
                raise PartitionError(
                    f"nodes {names} form a connected sub-graph that is not series-parallel "
                    "(no cut where every node before reaches every node after); pass "
                    "non_series_parallel='chain' or 'merge', or change the graph"
                )
            if non_series_parallel == "merge":
                return SPTree("leaf", nodes)
            return SPTree("series", nodes, tuple(SPTree("leaf", (v,)) for v in nodes))
        bounds = [0, *cuts, len(nodes)]
        pieces = [decompose(nodes[a:b]) for a, b in itertools.pairwise(bounds)]
        return SPTree("series", nodes, tuple(pieces))

    return decompose(tuple(order))


def branch_groupings(count: int, weights: Sequence[float]) -> list[tuple[tuple[int, ...], ...]]:
    """Returns the ways to group ``count`` parallel branches: every set partition when
    ``count <= MAX_GROUPED_BRANCHES``, else runs of consecutive branches by decreasing weight."""
    if count <= MAX_GROUPED_BRANCHES:
        return [tuple(g) for g in _set_partitions(list(range(count)))]
    ranked = sorted(range(count), key=lambda b: -weights[b])
    found = []
    for mask in range(1 << (count - 1)):
        groups, current = [], [ranked[0]]
        for k in range(1, count):
            if mask >> (k - 1) & 1:
                groups.append(tuple(current))
                current = []
            current.append(ranked[k])
        groups.append(tuple(current))
        found.append(tuple(groups))
    return found


def _set_partitions(items: list[int]) -> Iterator[list[tuple[int, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [(first,), *partition]
        for k in range(len(partition)):
            yield [*partition[:k], (first, *partition[k]), *partition[k + 1 :]]


# ------------------------------------------------------------------ dynamic programming


@dataclass(frozen=True)
class _Entry:
    """A partial plan: bottleneck stage time, longest path time, devices used, the time of
    the stage holding the sub-graph's last nodes (and its tail), and the stages' node sets."""

    bottleneck: float
    path: float
    used: int
    sink: float
    stages: tuple[tuple[int, ...], ...]


#: Entries of one sub-problem, by the depth (stages on the longest path) of their stage DAG.
_Table = dict[int, list[_Entry]]


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """Returns the entries no other entry beats on bottleneck, path, devices and sink time."""
    entries = sorted(entries, key=lambda e: (e.bottleneck, e.path, e.used, e.sink))
    kept: list[_Entry] = []
    for e in entries:
        if not any(
            k.bottleneck <= e.bottleneck
            and k.path <= e.path
            and k.used <= e.used
            and k.sink <= e.sink
            for k in kept
        ):
            kept.append(e)
    return kept


def _add(table: _Table, depth: int, entry: _Entry) -> None:
    table.setdefault(depth, []).append(entry)


def _prune(table: _Table) -> _Table:
    return {d: _pareto(entries) for d, entries in table.items()}


class _Search:
    """The DP of ``graph_partition`` over one op graph, memoised per sub-problem."""

    def __init__(self, graph: OpGraph, m: int, mem_limit: float | None) -> None:
        self.graph, self.m = graph, m
        self.mem_limit = math.inf if mem_limit is None else float(mem_limit)
        self.time = [n.forward_cost + n.backward_cost for n in graph.nodes]
        self.solve = cache(self._solve)

    def stage(self, nodes: tuple[int, ...], depth_after: int) -> _Entry | None:
        """Returns the one-stage entry for ``nodes``, or None when it breaks the memory limit."""
        g = self.graph.nodes
        activations = sum(g[v].activation_bytes for v in nodes)
        params = sum(g[v].param_bytes for v in nodes)
        if params + activations * min(self.m, 1 + depth_after) > self.mem_limit:
            return None
        t = sum(self.time[v] for v in nodes)
        return _Entry(t, t, 1, t, (tuple(sorted(nodes)),))

    def _solve(self, tree: SPTree, k: int, depth_after: int, tail: tuple[int, ...]) -> _Table:
        """Returns the plans for ``tree`` on at most ``k`` devices, followed by ``depth_after``
        stages, with the nodes ``tail`` joined to its last stage."""
        if k < 1:
            return {}
        if tree.kind == "leaf":
            entry = self.stage(tree.nodes + tail, depth_after)
            return {1: [entry]} if entry else {}
        if tree.kind == "series":
            return self._series(tree.children, k, depth_after, tail)
        return self._parallel(tree, k, depth_after, tail)

    def _series(
        self, children: tuple[SPTree, ...], k: int, depth_after: int, tail: tuple[int, ...]
    ) -> _Table:
        n = len(children)

        @cache
        def suffix(i: int, budget: int) -> _Table:
            # Plans for children[i:] on at most ``budget`` devices.
            if i == n:
                return {0: [_Entry(0.0, 0.0, 0, 0.0, ())]} if budget >= 0 else {}
            if budget < 1:
                return {}
            table: _Table = {}
            for j in range(i + 1, n + 1):
                run = tuple(v for c in children[i:j] for v in c.nodes)
                last = j == n
                # children[i:j] as one stage.
                for depth_rest, rest_entries in suffix(j, budget - 1).items():
                    first = self.stage(run + (tail if last else ()), depth_after + depth_rest)
                    if first is not None:
                        for rest in rest_entries:
                            _add(table, 1 + depth_rest, _chain(first, rest, last))
                # children[i] cut on its own, children[i+1:j] joined to its last stage.
                if children[i].kind == "leaf":
                    continue
                joined = tuple(v for c in children[i + 1 : j] for v in c.nodes)
                joined += tail if last else ()
                for depth_rest in range(0 if last else 1, budget):
                    if depth_rest not in suffix(j, budget - 1):
                        continue
                    firsts = self.solve(
                        children[i], budget - depth_rest, depth_after + depth_rest, joined
                    )
                    for depth_first, first_entries in firsts.items():
                        for first in first_entries:
                            rests = suffix(j, budget - first.used).get(depth_rest, ())
                            for rest in rests:
                                _add(table, depth_first + depth_rest, _chain(first, rest, last))
            return _prune(table)

        return suffix(0, k)

    def _parallel(self, tree: SPTree, k: int, depth_after: int, tail: tuple[int, ...]) -> _Table:
        branches = tree.children
        weights = [sum(self.time[v] for v in b.nodes) for b in branches]
        table: _Table = {}
        for groups in branch_groupings(len(branches), weights):
            if len(groups) > k:
                continue
            # A group of one branch is cut on its own; a group of several is one stage.
            options = [
                branches[group[0]]
                if len(group) == 1
                else SPTree("leaf", tuple(v for b in group for v in branches[b].nodes))
                for group in groups
            ]
            if not tail:
                merged = self._knapsack(options, k, depth_after)
                for depth, entries in merged.items():
                    for e in entries:
                        _add(table, depth, e)
                continue
            for c, carrier_tree in enumerate(options):
                others = options[:c] + options[c + 1 :]
                for depth_o, other_entries in self._knapsack(
                    others, k - 1, depth_after + 1
                ).items():
                    for other in other_entries:
                        carrier = self.solve(carrier_tree, k - other.used, depth_after, tail)
                        for depth_c, carrier_entries in carrier.items():
                            for ce in carrier_entries:
                                _add(
                                    table,
                                    max(depth_c, depth_o + 1 if depth_o else 0),
                                    _Entry(
                                        max(ce.bottleneck, other.bottleneck),
                                        max(ce.path, other.path + ce.sink if depth_o else 0.0),
                                        ce.used + other.used,
                                        ce.sink,
                                        ce.stages + other.stages,
                                    ),
                                )
        return _prune(table)

    def _knapsack(self, trees: list[SPTree], k: int, depth_after: int) -> _Table:
        """Returns side-by-side plans for independent ``trees`` sharing at most ``k`` devices."""
        table: _Table = {0: [_Entry(0.0, 0.0, 0, 0.0, ())]}
        for position, tree in enumerate(trees):
            later = len(trees) - position - 1  # each later tree needs a device
            grown: _Table = {}
            for depth_a, entries in table.items():
                for a in entries:
                    budget = k - a.used - later
                    for depth_b, entries_b in self.solve(tree, budget, depth_after, ()).items():
                        for b in entries_b:
                            _add(
                                grown,
                                max(depth_a, depth_b),
                                _Entry(
                                    max(a.bottleneck, b.bottleneck),
                                    max(a.path, b.path),
                                    a.used + b.used,
                                    0.0,
                                    a.stages + b.stages,
                                ),
                            )
            table = _prune(grown)
        return table


def _chain(first: _Entry, rest: _Entry, first_is_last: bool) -> _Entry:
    """Returns ``first`` followed in series by ``rest``."""
    return _Entry(
        max(first.bottleneck, rest.bottleneck),
        first.path + rest.path,
        first.used + rest.used,
        first.sink if first_is_last else rest.sink,
        first.stages + rest.stages,
    )


# ------------------------------------------------------------------ partitions


def step_estimate(bottleneck: float, path: float, num_microbatches: int) -> float:
    """Returns the cost model's pipeline step time: path + (m - 1) * bottleneck."""
    return path + (num_microbatches - 1) * bottleneck


def dag_step_estimate(
    times: Sequence[float], edges: Iterable[tuple[int, int]], num_microbatches: int
) -> float:
    """Returns :func:`step_estimate` of a stage DAG whose stages (numbered in topological
    order, each on its own device) take ``times``: one microbatch's longest path through the
    stages plus m - 1 times the slowest stage."""
    edges = tuple(edges)
    path = [0.0] * len(times)
    for s in reversed(range(len(times))):
        path[s] = times[s] + max((path[b] for a, b in edges if a == s), default=0.0)
    return step_estimate(max(times), max(path), num_microbatches)


def partition_from_stages(
    graph: OpGraph,
    stages: Sequence[Sequence[int]],
    num_microbatches: int,
    extra_edges: Sequence[tuple[int, int]] = (),
) -> GraphPartition:
    """Returns the partition whose stages hold the given node sets (one device per stage).

    Stages are renumbered in topological order of the stage DAG that the op graph's edges
    induce (plus ``extra_edges`` between the given stage indices, e.g. a chain's order).
    """
    num_microbatches = count("num_microbatches", num_microbatches, PartitionError)
    n = len(graph.nodes)
    stage_of = [-1] * n
    for s, nodes in enumerate(stages):
        if integer(nodes) is not None or isinstance(nodes, str | bytes):
            raise PartitionError(
                f"stages[{s}] = {nodes!r} is not a list of nodes; give the nodes of each stage, "
                "e.g. [[0, 1], [2]] (not a stage per node, as GraphPartition.stage_of_node)"
            )
        if not len(nodes):
            raise PartitionError(f"stage {s} holds no node; give every stage at least one")
        for v in nodes:
            index = integer(v)
            if index is None or not 0 <= index < n:
                raise PartitionError(
                    f"stage {s} names node {v!r}; nodes are numbered 0..{n - 1} (OpGraph.nodes)"
                )
            if stage_of[index] >= 0:
                where = "twice in stage" if stage_of[index] == s else "in two stages"
                raise PartitionError(f"node {graph.nodes[index].name!r} is {where}")
            stage_of[index] = s
    if min(stage_of) < 0:
        missing = [graph.nodes[v].name for v in range(n) if stage_of[v] < 0]
        raise PartitionError(f"nodes {missing} are in no stage; every node needs one")
    raw = {(stage_of[a], stage_of[b]) for a, b in graph.edges if stage_of[a] != stage_of[b]}
    for edge in extra_edges:
        try:
            pair = () if isinstance(edge, str | bytes) else tuple(edge)
        except TypeError:  # an int, say
            pair = ()
        if len(pair) != 2 or not all(integer(x) is not None and 0 <= x < len(stages) for x in pair):
            raise PartitionError(
                f"extra edge {edge!r} is not a pair of stages in 0..{len(stages) - 1}; give "
                "(src, dst) pairs of the given stages' indices"
            )
    raw |= {(int(a), int(b)) for a, b in extra_edges}
    order = topological_order(len(stages), sorted(raw))
    if len(order) != len(stages):
        raise PartitionError("these stages have a cycle between them; a stage DAG must be acyclic")
    new = {old: k for k, old in enumerate(order)}
    stage_of = [new[s] for s in stage_of]
    edges = tuple(sorted((new[a], new[b]) for a, b in raw))
    members = [[] for _ in stages]
    for v in range(n):
        members[stage_of[v]].append(v)
    g = graph.nodes

    def total(attr: str, s: int) -> float:
        return float(sum(getattr(g[v], attr) for v in members[s]))

    p = len(stages)
    forward = tuple(total("forward_cost", s) for s in range(p))
    weight = tuple(float(sum(g[v].w_cost for v in members[s])) for s in range(p))
    backward = tuple(total("backward_cost", s) - weight[s] for s in range(p))
    times = [forward[s] + backward[s] + weight[s] for s in range(p)]
    names = tuple(
        g[members[s][0]].name
        if len(members[s]) == 1
        else f"{g[members[s][0]].name}..{g[members[s][-1]].name}"
        for s in range(p)
    )
    return GraphPartition(
        stage_of_node=tuple(stage_of),
        placement=tuple(range(p)),
        edges=edges,
        stage_names=names,
        predicted_step_time=dag_step_estimate(times, edges, num_microbatches),
        num_microbatches=num_microbatches,
        forward=forward,
        backward_input=backward,
        backward_weight=weight,
        activation_bytes=tuple(total("activation_bytes", s) for s in range(p)),
        param_bytes=tuple(total("param_bytes", s) for s in range(p)),
    )


def graph_partition(
    graph: OpGraph,
    num_devices: int,
    num_microbatches: int,
    mem_limit: float | None = None,
    refine: int = 8,
    non_series_parallel: str = "chain",
) -> GraphPartition:
    """Returns the graph pipeline partition of ``graph`` on at most ``num_devices`` devices.

    The dynamic programming minimises the cost model's step time (module docstring) under
    ``mem_limit`` (bytes per device; None: no limit); then the ``refine`` best plans are
    simulated with dag-1f1b and the fastest simulated one is returned (``refine=0``: the
    cost model's best, unsimulated), or the best chain (``chain_partition``) where it fits
    ``mem_limit`` and simulates faster (but with ``non_series_parallel="merge"``). Raises
    PartitionError when no plan fits ``mem_limit``.
    """
    if not isinstance(graph, OpGraph):
        raise PartitionError(
            f"graph_partition takes an OpGraph (OpGraph(nodes, edges), or "
            f"op_graph_from_jaxpr(...).graph), not {type(graph).__name__} {graph!r:.40}"
        )
    num_devices = count("num_devices", num_devices, PartitionError)
    num_microbatches = count("num_microbatches", num_microbatches, PartitionError)
    refine = count("refine", refine, PartitionError, at_least=0)
    if mem_limit is not None:
        limit = real_number(mem_limit)
        if limit is None or not limit > 0:  # (NaN too)
            raise PartitionError(
                f"mem_limit = {mem_limit!r}; give the bytes each device may hold, a number "
                "> 0, or None for no limit"
            )
    tree = series_parallel_tree(graph, non_series_parallel)
    search = _Search(graph, num_microbatches, mem_limit)
    table = search.solve(tree, num_devices, 0, ())
    plans = sorted(
        (step_estimate(e.bottleneck, e.path, num_microbatches), e.stages)
        for entries in table.values()
        for e in entries
    )
    if not plans:
        raise PartitionError(
            f"no partition of the {len(graph.nodes)} op nodes on {num_devices} devices keeps "
            f"every device within mem_limit = {mem_limit:g} bytes with {num_microbatches} "
            "microbatches; raise mem_limit, add devices or use fewer microbatches"
        )
    if refine == 0:
        return partition_from_stages(graph, plans[0][1], num_microbatches)
    best = None
    for _, stages in plans[:refine]:
        partition = partition_from_stages(graph, stages, num_microbatches)
        run = simulate(schedule_for(partition, num_microbatches), partition.costs)
        if best is None or run.makespan < best.simulated_step_time - 1e-9:
            best = _with_simulated(partition, run.makespan)
    # The series-parallel search misses some cuts a chain makes: a fan-out node never shares
    # a stage with one branch's first nodes (a stem and one tower | the other tower and the
    # head). The best chain, where it fits mem_limit and simulates faster, is returned instead
    # (not with "merge", which keeps a non-series-parallel part in one stage).
    if non_series_parallel == "merge":
        return best
    chain = chain_partition(graph, num_devices, num_microbatches)
    fits = mem_limit is None or max(chain.stage_memory()) <= mem_limit
    if fits and chain.simulated_step_time < best.simulated_step_time - 1e-9:
        return chain
    return best


def _with_simulated(partition: GraphPartition, makespan: float) -> GraphPartition:
    return replace(partition, simulated_step_time=makespan)


def chain_partition(graph: OpGraph, num_devices: int, num_microbatches: int = 1) -> GraphPartition:
    """Returns the best sequential partition: contiguous chunks of a topological order.

    Chunks minimise the largest stage time (exactly, by dynamic programming) over
    min(num_devices, number of nodes) stages; the stage graph is the chain plus any edge
    the op graph adds (skip connections), as a sequential pipeline runs it.
    """
    num_devices = count("num_devices", num_devices, PartitionError)
    num_microbatches = count("num_microbatches", num_microbatches, PartitionError)
    n = len(graph.nodes)
    order = topological_order(n, graph.edges)
    times = [graph.nodes[v].forward_cost + graph.nodes[v].backward_cost for v in order]
    p = min(num_devices, n)
    prefix = [0.0, *itertools.accumulate(times)]
    # best[j][q]: least bottleneck for the first q nodes in j chunks; cut[j][q]: last cut.
    best = [[math.inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for j in range(1, p + 1):
        for q in range(j, n + 1):
            for r in range(j - 1, q):
                value = max(best[j - 1][r], prefix[q] - prefix[r])
                if value < best[j][q] - 1e-12:
                    best[j][q], cut[j][q] = value, r
    bounds, q = [n], n
    for j in range(p, 0, -1):
        q = cut[j][q]
        bounds.append(q)
    bounds.reverse()
    stages = [order[a:b] for a, b in itertools.pairwise(bounds)]
    partition = partition_from_stages(graph, stages, num_microbatches, chain_edges(p))
    run = simulate(schedule_for(partition, num_microbatches), partition.costs)
    return _with_simulated(partition, run.makespan)


def schedule_for(
    partition: GraphPartition,
    num_microbatches: int,
    kind: str = "dag-1f1b",
    **options: Any,
) -> Schedule:
    """Returns the ``kind`` ("dag-1f1b" or "dag-zb") schedule of a partition's stage DAG.

    dag-zb is searched with the partition's stage costs; ``options`` go to ``dag_zb``
    (``mem_limit``, ``w_mem``, ``search_time``).
    """
    if kind == "dag-1f1b":
        if options:
            raise PartitionError(f"dag-1f1b takes no options, but got {sorted(options)}")
        return dag_1f1b(
            partition.edges, partition.placement, num_microbatches, partition.stage_names
        )
    if kind == "dag-zb":
        return dag_zb(
            partition.edges,
            partition.placement,
            num_microbatches,
            costs=options.pop("costs", partition.costs),
            stage_names=partition.stage_names,
            **options,
        )
    raise PartitionError(f"schedule kind {kind!r}; use 'dag-1f1b' or 'dag-zb'")


# ------------------------------------------------------------------ reference op graphs


def transformer_layer_costs(hidden: int, heads: int, seq: int) -> tuple[float, float, float]:
    """Returns (F, B, W) matmul FLOPs of one transformer layer for one sequence.

    F: QKV 6sh^2, attention output 2sh^2, MLP (4h) 16sh^2, scores and values 4s^2h. B (input
    gradients) repeats the weight matmuls once and the attention matmuls twice; W (weight
    gradients) repeats the weight matmuls once.
    """
    del heads  # the FLOPs do not depend on how the hidden size is split into heads
    s, h = float(seq), float(hidden)
    weights, attention = 24 * s * h * h, 4 * s * s * h
    return weights + attention, weights + 2 * attention, weights


def multimodal_transformer_graph(
    branches: int = 4,
    layers: int = 12,
    hidden: int = 1024,
    heads: int = 16,
    seq: int = 256,
    num_classes: int = 1000,
    bytes_per_value: int = 2,
) -> OpGraph:
    """Returns GraphPipe's multi-modal transformer as an op graph with analytic costs.

    Each branch is an embedding then ``layers`` transformer layers over its own modality; a
    concat joins the branches' pooled features, and a head (a 4h -> h projection over the
    sequence, then h -> num_classes) ends the model. Costs are matmul FLOPs per sequence
    (``transformer_layer_costs``); activation bytes follow the Zero Bubble paper's
    s * h * 34 + 5 * a * s^2 per layer (16-bit values); params are 12 h^2 values per layer.
    """
    s, h = seq, hidden
    f, b, w = transformer_layer_costs(hidden, heads, seq)
    layer_acts = (34 * s * h + 5 * heads * s * s) * bytes_per_value / 2
    nodes: list[OpNode] = []
    edges: list[tuple[int, int]] = []
    ends = []
    for branch in range(branches):
        # The embedding is a gather: its cost is the bytes it writes, at ~100 FLOPs a byte.
        gather = 100.0 * s * h * bytes_per_value
        nodes.append(OpNode(f"m{branch}.embed", gather, gather, gather / 2, s * h * 2, 0.0))
        for layer in range(layers):
            nodes.append(
                OpNode(
                    f"m{branch}.layer{layer}",
                    f,
                    b + w,
                    w,
                    layer_acts,
                    12 * h * h * bytes_per_value,
                )
            )
            edges.append((len(nodes) - 2, len(nodes) - 1))
        ends.append(len(nodes) - 1)
    concat_bytes = 100.0 * branches * s * h * bytes_per_value
    nodes.append(OpNode("concat", concat_bytes, concat_bytes, 0.0, branches * s * h * 2, 0.0))
    edges += [(end, len(nodes) - 1) for end in ends]
    head_f = 2.0 * s * branches * h * h + 2.0 * h * num_classes
    head_params = (branches * h * h + h * num_classes) * bytes_per_value
    nodes.append(OpNode("head", head_f, 2 * head_f, head_f, s * h * 4, head_params))
    edges.append((len(nodes) - 2, len(nodes) - 1))
    return OpGraph(tuple(nodes), tuple(edges))


def peak_activation_bytes(partition: GraphPartition, schedule: Schedule) -> tuple[float, ...]:
    """Returns each device's peak activation bytes when ``schedule`` runs ``partition``.

    Walks each device's actions: F adds its stage's activation bytes, B frees all but the
    ``w_mem`` part, W frees that part, BW frees all (``peak_memory``'s rule, in bytes).
    """
    peaks = []
    for program in schedule.actions:
        level = peak = 0.0
        for action in program:
            size = partition.activation_bytes[action.stage]
            level += {
                "F": size,
                "B": -(1.0 - schedule.w_mem) * size,
                "W": -schedule.w_mem * size,
                "BW": -size,
            }[action.kind]
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


# ------------------------------------------------------------------ from a traced program


@dataclass(frozen=True)
class JaxprOpGraph:
    """An op graph built from a jaxpr and, per node, the indices of its equations."""

    graph: OpGraph
    node_equations: tuple[tuple[int, ...], ...]
    equation_costs: tuple[float, ...]  # ``cost_model.equation_cost`` of each equation

    def equation_stages(self, partition: GraphPartition) -> tuple[int, ...]:
        """Returns the stage of every equation of the jaxpr under ``partition``."""
        stages = [0] * sum(len(eqns) for eqns in self.node_equations)
        for node, eqns in enumerate(self.node_equations):
            for i in eqns:
                stages[i] = partition.stage_of_node[node]
        return tuple(stages)


def _join_loss_node(
    jaxpr: Any, eqns: list, node_of: list[int], node_cost: list[float], reads: Any
) -> tuple[list[int], list[float]]:
    """Returns the nodes with those that do not feed the loss (``jaxpr.outvars[0]``), such as
    an aux metric computed after the loss, joined to the loss's node: every stage must feed
    the loss, which the last stage computes. Nodes are renumbered in order."""
    from jax.extend.core import Var

    loss = jaxpr.outvars[0]
    if not isinstance(loss, Var):  # a constant loss: nothing feeds it
        return node_of, node_cost
    needed = {loss}
    feeding: set[int] = set()
    for i in reversed(range(len(eqns))):
        if any(v in needed for v in eqns[i].outvars):
            needed.update(reads(eqns[i]))
            if node_of[i] >= 0:
                feeding.add(node_of[i])
    if not feeding or len(feeding) == len(node_cost):
        return node_of, node_cost
    loss_node = max(feeding)
    for k in range(len(node_cost)):
        if k not in feeding:
            node_cost[loss_node] += node_cost[k]
    index = {k: j for j, k in enumerate(sorted(feeding))}
    return (
        [-1 if n < 0 else index[n if n in feeding else loss_node] for n in node_of],
        [node_cost[k] for k in sorted(feeding)],
    )


def op_graph_from_jaxpr(
    closed_jaxpr: Any,
    num_params: int = 0,
    max_node_cost: float | None = None,
    target_nodes: int = 64,
) -> JaxprOpGraph:
    """Returns the op graph of a traced program, grouping its equations into coarse nodes.

    ``closed_jaxpr`` is one microbatch's program whose first ``num_params`` inputs are the
    parameters (the layout ``zbjax.partition`` traces; inline ``jit`` calls first to see
    markers inside them). *Activation* equations (those that depend on a non-param input)
    are walked in traced order; one joins the current node when it reads a value the current
    node computed and (without markers) the node's cost stays within ``max_node_cost``
    (default: total cost / ``target_nodes``); otherwise it starts a new node. A
    ``stage_boundary`` marker always starts a new node, and with markers present only they
    and dataflow cut nodes, never cost. So independent branches never share a node, and a
    fan-in (a concat) joins the node of the branch traced last. Other equations (params
    only: transposes, casts, constants) go to the node of their earliest reader. Node costs
    come from ``zbjax.cost_model``: forward = ``equation_cost`` summed; W = the cost of
    matmuls with an operand computed from params only; backward = forward + W. Activation
    bytes are the bytes of the activation equations' outputs, param bytes those of the
    params the node reads.
    """
    from jax.extend.core import Literal

    from zbjax.cost_model import aval_bytes, equation_cost
    from zbjax.markers import is_stage_boundary

    jaxpr = closed_jaxpr.jaxpr
    eqns = list(jaxpr.eqns)
    if not eqns:
        raise PartitionError("the jaxpr has no equations; there is nothing to partition")
    params = set(jaxpr.invars[:num_params]) | set(jaxpr.constvars)
    activation = set(jaxpr.invars[num_params:])
    param_only = set(params)

    def reads(eqn: Any) -> list:
        return [v for v in eqn.invars if not isinstance(v, Literal)]

    is_activation = []
    for eqn in eqns:
        active = any(v in activation for v in reads(eqn))
        is_activation.append(active)
        if active:
            activation.update(eqn.outvars)
        elif all(v in param_only for v in reads(eqn)):
            param_only.update(eqn.outvars)
    cost = [equation_cost(eqn) for eqn in eqns]
    has_markers = any(is_stage_boundary(eqn) for eqn in eqns)
    total = sum(c for c, a in zip(cost, is_activation, strict=True) if a)
    limit = max_node_cost if max_node_cost is not None else total / max(1, target_nodes)

    node_of: list[int] = [-1] * len(eqns)
    defined_in: dict[Any, int] = {}
    node_cost: list[float] = []
    for i, eqn in enumerate(eqns):
        if not is_activation[i]:
            continue
        parents = {defined_in[v] for v in reads(eqn) if v in defined_in}
        current = len(node_cost) - 1
        joins = (
            current >= 0
            and current in parents
            and not is_stage_boundary(eqn)
            and (has_markers or node_cost[current] + cost[i] <= limit or node_cost[current] == 0)
        )
        if not joins:
            node_cost.append(0.0)
            current += 1
        node_of[i] = current
        node_cost[current] += cost[i]
        defined_in.update((v, current) for v in eqn.outvars)
    if not node_cost:
        node_cost.append(0.0)  # no activation at all: the whole program is one node
    node_of, node_cost = _join_loss_node(jaxpr, eqns, node_of, node_cost, reads)
    # Equations on params only go to their earliest reader's node (the last node if none).
    last = len(node_cost) - 1
    read_at: dict[Any, int] = {}
    for i in reversed(range(len(eqns))):
        if node_of[i] < 0:
            node_of[i] = min((read_at[v] for v in eqns[i].outvars if v in read_at), default=last)
        for v in reads(eqns[i]):
            read_at[v] = min(read_at.get(v, last), node_of[i])

    producer = {v: node_of[i] for i, eqn in enumerate(eqns) for v in eqn.outvars}
    edges = {
        (producer[v], node_of[i])
        for i, eqn in enumerate(eqns)
        for v in reads(eqn)
        if v in producer and producer[v] != node_of[i]
    }
    members: list[list[int]] = [[] for _ in node_cost]
    for i, node in enumerate(node_of):
        members[node].append(i)
    nodes = []
    for k, eqn_ids in enumerate(members):
        forward = sum(cost[i] for i in eqn_ids)
        weight = sum(
            cost[i]
            for i in eqn_ids
            if eqns[i].primitive.name in ("dot_general", "conv_general_dilated")
            and any(v in param_only for v in reads(eqns[i]))
        )
        acts = sum(aval_bytes(v.aval) for i in eqn_ids if is_activation[i] for v in eqns[i].outvars)
        read_params = {v for i in eqn_ids for v in reads(eqns[i]) if v in params}
        first = eqns[eqn_ids[0]].primitive.name if eqn_ids else "empty"
        nodes.append(
            OpNode(
                f"node{k}:{first}",
                float(forward),
                float(forward + weight),
                float(weight),
                float(acts),
                float(sum(aval_bytes(v.aval) for v in read_params)),
            )
        )
    return JaxprOpGraph(
        OpGraph(tuple(nodes), tuple(sorted(edges))), tuple(map(tuple, members)), tuple(cost)
    )
