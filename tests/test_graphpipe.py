"""GraphPipe partitioner: series-parallel decomposition, DP equals brute force, acceptance."""

import itertools
import random
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from zbjax.errors import PartitionError
from zbjax.graphpipe import (
    OpGraph,
    OpNode,
    branch_groupings,
    chain_partition,
    graph_partition,
    multimodal_transformer_graph,
    op_graph_from_jaxpr,
    partition_from_stages,
    peak_activation_bytes,
    schedule_for,
    series_parallel_tree,
)
from zbjax.schedules import peak_memory, simulate, validate
from zbjax.schedules.dag import longest_span


def _node(name, cost=1.0, acts=1.0, params=0.0):
    return OpNode(name, cost, 2 * cost, cost, acts, params)


def _graph(costs, edges):
    return OpGraph(tuple(_node(f"n{k}", c) for k, c in enumerate(costs)), tuple(edges))


def _shape(tree):
    if tree.kind == "leaf":
        return tree.nodes[0] if len(tree.nodes) == 1 else ("merged", tree.nodes)
    return (tree.kind, *(_shape(c) for c in tree.children))


def test_diamond_decomposes_into_series_of_parallel():
    tree = series_parallel_tree(_graph([1] * 4, [(0, 1), (0, 2), (1, 3), (2, 3)]))
    assert _shape(tree) == ("series", 0, ("parallel", 1, 2), 3)


def test_fan_in_of_chains_decomposes_into_parallel_chains_then_head():
    edges = [(0, 1), (2, 3), (1, 4), (3, 4), (4, 5)]
    tree = series_parallel_tree(_graph([1] * 6, edges))
    assert _shape(tree) == ("series", ("parallel", ("series", 0, 1), ("series", 2, 3)), 4, 5)


N_GRAPH = [(0, 2), (1, 2), (1, 3)]  # a -> c, b -> c, b -> d: the smallest non-SP graph


def test_non_series_parallel_graph_is_chained_merged_or_refused():
    graph = _graph([1] * 4, N_GRAPH)
    assert _shape(series_parallel_tree(graph, "merge")) == ("merged", (0, 1, 2, 3))
    assert _shape(series_parallel_tree(graph, "chain"))[0] == "series"
    with pytest.raises(PartitionError, match="not series-parallel"):
        series_parallel_tree(graph, "error")
    with pytest.raises(PartitionError, match="non_series_parallel"):
        series_parallel_tree(graph, "split")
    for mode, most_stages in (("chain", 4), ("merge", 1)):
        partition = graph_partition(graph, 4, 4, non_series_parallel=mode)
        assert partition.num_stages <= most_stages
        validate(schedule_for(partition, 4))
        assert all(a < b for a, b in partition.edges)
    # A non-SP part inside an SP graph: only that part is affected.
    inner = _graph([1] * 6, [(0, 1), (0, 2), (1, 3), (2, 3), (2, 4), (3, 5), (4, 5)])
    validate(schedule_for(graph_partition(inner, 3, 4), 4))
    with pytest.raises(PartitionError, match="takes an OpGraph"):
        graph_partition("g", 2, 4)
    with pytest.raises(PartitionError, match="num_microbatches = 0"):
        graph_partition(inner, 3, 4).stage_memory(0)


def test_op_graph_and_arguments_are_checked():
    with pytest.raises(PartitionError, match="cycle"):
        _graph([1, 1], [(0, 1), (1, 0)])
    with pytest.raises(PartitionError, match="weight_cost"):
        OpGraph((OpNode("x", 1.0, 1.0, 2.0),), ())
    with pytest.raises(PartitionError, match="num_devices"):
        graph_partition(_graph([1], []), 0, 4)
    with pytest.raises(PartitionError, match="mem_limit"):
        graph_partition(_graph([1, 1], [(0, 1)]), 2, 4, mem_limit=0.5)
    # int() truncated a fractional edge end; a string or NaN cost failed later, unnamed.
    with pytest.raises(PartitionError, match=r"edge \(0\.5, 1\.9\) names node 0\.5"):
        _graph([1, 1], [(0.5, 1.9)])
    with pytest.raises(PartitionError, match="op node 'a' has forward_cost = '1'"):
        OpGraph((OpNode("a", "1", 1.0),), ())
    with pytest.raises(PartitionError, match="op node 'a' has forward_cost = nan"):
        OpGraph((OpNode("a", float("nan"), 1.0),), ())
    with pytest.raises(PartitionError, match="node 1 is a int, not an OpNode"):
        OpGraph((1, 2), ())
    chain = _graph([1, 2, 1], [(0, 1), (1, 2)])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(PartitionError, match=f"num_devices = {bad!r}; it must be an integer"):
            chain_partition(chain, bad)
    with pytest.raises(PartitionError, match="refine = -3; it must be an integer >= 0"):
        graph_partition(chain, 2, 4, refine=-3)
    # partition_from_stages and mem_limit were barely checked: raw IndexErrors, node -1 taken
    # as the last node, num_microbatches = 0 and mem_limit = NaN accepted (helper HA).
    bad_stages = [
        ([[0, 1], [], [2]], "stage 1 holds no node"),
        ([[0, 7], [1, 2]], "stage 0 names node 7; nodes are numbered 0..2"),
        ([[0, 1], [-1]], "stage 1 names node -1"),
    ]
    for stages, message in bad_stages:
        with pytest.raises(PartitionError, match=message):
            partition_from_stages(chain, stages, 4)
    with pytest.raises(PartitionError, match="num_microbatches = 0"):
        partition_from_stages(chain, [[0, 1], [2]], 0)
    for edges in ([(0, 5)], [(0, 1, 2)], [0, 1]):
        with pytest.raises(PartitionError, match=r"extra edge .* is not a pair of stages in 0..1"):
            partition_from_stages(chain, [[0, 1], [2]], 4, extra_edges=edges)
    with pytest.raises(PartitionError, match=r"stages\[0\] = 0 is not a list of nodes"):
        partition_from_stages(chain, [0, 0, 1], 4)  # a stage per node: stage_of_node's form
    with pytest.raises(PartitionError, match="node 'n0' is twice in stage"):
        partition_from_stages(chain, [[0, 0], [1, 2]], 4)
    for limit in (float("nan"), 0, "1e9"):
        with pytest.raises(PartitionError, match=f"mem_limit = {limit!r}; give the bytes"):
            graph_partition(chain, 2, 4, mem_limit=limit)
    # NumPy integers are integers.
    assert graph_partition(chain, np.int64(2), np.int64(4)).num_stages == 2
    assert chain_partition(chain, np.int64(2), np.int64(4)).num_stages == 2


def test_branch_groupings_are_set_partitions_for_few_branches():
    assert len(branch_groupings(4, [1] * 4)) == 15  # Bell(4)
    assert len(branch_groupings(8, list(range(8)))) == 2**7


# ----------------------------------------------------------------------------- brute force


def _random_sp_graph(rng, leaves):
    """Returns a random series-parallel op graph (series joins every sink to every source)."""
    edges = []

    def build(count, start):
        # Returns (sources, sinks, next id) of a random SP graph on nodes start..start+count-1.
        if count == 1:
            return [start], [start], start + 1
        left = rng.randint(1, count - 1)
        a_src, a_snk, mid = build(left, start)
        b_src, b_snk, end = build(count - left, mid)
        if rng.random() < 0.5:
            edges.extend((x, y) for x in a_snk for y in b_src)
            return a_src, b_snk, end
        return a_src + b_src, a_snk + b_snk, end

    build(leaves, 0)
    nodes = tuple(
        OpNode(
            f"n{k}",
            rng.randint(1, 4),
            2 * rng.randint(1, 4),
            1,
            rng.randint(0, 3),
            rng.randint(0, 2),
        )
        for k in range(leaves)
    )
    return OpGraph(nodes, tuple(edges))


def _plans(tree, k, time, tail=()):
    """Yields every plan (list of stages) the search space allows, without any DP.

    ``time[v]`` is node v's forward + backward cost: past ``MAX_GROUPED_BRANCHES`` parallel
    branches the space groups runs of branches ranked by that weight, as the partitioner does.
    """
    if k < 1:
        return
    if tree.kind == "leaf":
        yield [tree.nodes + tail]
        return
    if tree.kind == "series":
        children = tree.children
        n = len(children)

        def suffix(i, budget):
            if i == n:
                if budget >= 0:
                    yield []
                return
            if budget < 1:
                return
            for j in range(i + 1, n + 1):
                last = j == n
                run = tuple(v for c in children[i:j] for v in c.nodes) + (tail if last else ())
                for rest in suffix(j, budget - 1):
                    yield [run, *rest]
                if children[i].kind != "leaf":
                    joined = tuple(v for c in children[i + 1 : j] for v in c.nodes)
                    joined += tail if last else ()
                    for first in _plans(children[i], budget, time, joined):
                        for rest in suffix(j, budget - len(first)):
                            yield first + rest

        yield from suffix(0, k)
        return
    branches = tree.children
    weights = [sum(time[v] for v in b.nodes) for b in branches]
    for groups in branch_groupings(len(branches), weights):
        trees = [
            branches[g[0]]
            if len(g) == 1
            else type(tree)("leaf", tuple(v for b in g for v in branches[b].nodes))
            for g in groups
        ]
        carriers = range(len(trees)) if tail else [None]
        for carrier in carriers:
            options = [
                list(_plans(t, k, time, tail if c == carrier else ())) for c, t in enumerate(trees)
            ]
            for combo in itertools.product(*options):
                stages = [s for plan in combo for s in plan]
                if len(stages) <= k:
                    yield stages


def _evaluate(graph, stages, m, mem_limit):
    """Returns path + (m-1) * bottleneck of a plan computed from its stage DAG, or None when a
    stage's device needs more than mem_limit (independent of the module's bookkeeping)."""
    stage_of = {v: s for s, nodes in enumerate(stages) for v in nodes}
    assert sorted(stage_of) == list(range(len(graph.nodes)))
    edges = {(stage_of[a], stage_of[b]) for a, b in graph.edges if stage_of[a] != stage_of[b]}
    time_of = [
        sum(graph.nodes[v].forward_cost + graph.nodes[v].backward_cost for v in s) for s in stages
    ]
    path, depth = {}, {}

    def longest(s):
        if s not in path:
            nxt = [b for a, b in edges if a == s]
            path[s] = time_of[s] + max((longest(b) for b in nxt), default=0.0)
            depth[s] = 1 + max((depth[b] for b in nxt), default=0)
        return path[s]

    total = max(longest(s) for s in range(len(stages)))
    for s, nodes in enumerate(stages):
        acts = sum(graph.nodes[v].activation_bytes for v in nodes)
        params = sum(graph.nodes[v].param_bytes for v in nodes)
        if mem_limit is not None and params + acts * min(m, depth[s]) > mem_limit:
            return None
    return total + (m - 1) * max(time_of)


@settings(max_examples=200, deadline=None)
@example(521, 7, 2, 1, None)  # 7 parallel branches: grouped by weight, not by index
@given(
    st.integers(0, 10**9),
    st.integers(2, 7),
    st.integers(1, 4),
    st.integers(1, 8),
    st.sampled_from([None, 3, 4, 5, 6, 8, 11]),
)
def test_partitioner_equals_brute_force_on_small_series_parallel_graphs(
    seed, leaves, devices, m, mem_limit
):
    graph = _random_sp_graph(random.Random(seed), leaves)
    tree = series_parallel_tree(graph, "error")  # generated graphs are series-parallel
    time = [n.forward_cost + n.backward_cost for n in graph.nodes]
    scores = [_evaluate(graph, plan, m, mem_limit) for plan in _plans(tree, devices, time)]
    feasible = [x for x in scores if x is not None]
    if not feasible:
        with pytest.raises(PartitionError, match="mem_limit"):
            graph_partition(graph, devices, m, mem_limit=mem_limit, refine=0)
        return
    chosen = graph_partition(graph, devices, m, mem_limit=mem_limit, refine=0)
    assert chosen.predicted_step_time == pytest.approx(min(feasible))
    assert chosen.num_stages <= devices
    # The chosen stages, evaluated independently, score what the DP said and fit memory.
    stages = [
        [v for v, s in enumerate(chosen.stage_of_node) if s == k] for k in range(chosen.num_stages)
    ]
    assert _evaluate(graph, stages, m, mem_limit) == pytest.approx(chosen.predicted_step_time)
    if mem_limit is not None:
        assert max(chosen.stage_memory()) <= mem_limit
    # Refining by simulation never picks a plan that simulates slower than the DP's best.
    refined = graph_partition(graph, devices, m, mem_limit=mem_limit, refine=4)
    best_run = simulate(schedule_for(chosen, m), chosen.costs).makespan
    assert refined.simulated_step_time <= best_run + 1e-9
    # Nor one slower than the best chain that fits mem_limit.
    chain = chain_partition(graph, devices, m)
    if mem_limit is None or max(chain.stage_memory()) <= mem_limit:
        assert refined.simulated_step_time <= chain.simulated_step_time + 1e-9


def test_a_stem_shares_a_stage_with_one_branch_where_that_is_faster():
    """A stem feeding two towers joined by a head, on 2 devices: the series-parallel search
    cannot put the stem with one tower (it put stem, both towers | head: 216 simulated); the
    chain {stem, A} | {B, head} (135) is returned instead (helper HA, session 43)."""
    graph = OpGraph(
        [
            OpNode("stem", 1.0, 2.0),
            OpNode("A", 4.0, 8.0),
            OpNode("B", 4.0, 8.0),
            OpNode("join", 1.0, 2.0),
        ],
        [(0, 1), (0, 2), (1, 3), (2, 3)],
    )
    chosen = graph_partition(graph, 2, 8)
    assert chosen.stage_of_node == (0, 0, 1, 1)
    assert chosen.simulated_step_time == pytest.approx(135.0)
    assert graph_partition(graph, 2, 8, refine=0).stage_of_node == (0, 0, 0, 1)


def test_partition_stages_are_topologically_numbered_and_schedulable():
    graph = _graph([1, 2, 2, 1, 3, 1], [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (3, 5)])
    partition = partition_from_stages(graph, [[4], [0], [1, 2, 3], [5]], 4)
    assert all(a < b for a, b in partition.edges)
    assert partition.stage_of_node[0] == 0
    validate(schedule_for(partition, 4))
    validate(schedule_for(partition, 4, "dag-zb"))
    with pytest.raises(PartitionError, match="two stages"):
        partition_from_stages(graph, [[0, 1], [1, 2, 3, 4, 5]], 4)
    with pytest.raises(PartitionError, match="'dag-1f1b' or 'dag-zb'"):
        schedule_for(partition, 4, "1f1b")


def test_chain_partition_balances_contiguous_chunks():
    graph = _graph([1, 1, 4, 1, 1, 2], [(k, k + 1) for k in range(5)])
    chain = chain_partition(graph, 3, 4)
    assert chain.stage_of_node == (0, 0, 1, 2, 2, 2)
    assert chain.edges == ((0, 1), (1, 2))


# ----------------------------------------------------------------------------- acceptance


@pytest.fixture(scope="module")
def multimodal():
    """The 4-branch multi-modal transformer (12 layers per branch), partitioned on 8 devices."""
    graph = multimodal_transformer_graph()
    start = time.perf_counter()
    partition = graph_partition(graph, 8, 8)
    return graph, partition, time.perf_counter() - start


def test_multimodal_graph_partitions_in_under_ten_seconds(multimodal):
    graph, partition, seconds = multimodal
    assert len(graph.nodes) >= 50 and seconds < 10.0
    assert partition.num_stages == 8 and partition.depth() < 8


def test_graph_pipeline_beats_the_chain_by_a_quarter_with_less_activation_memory(multimodal):
    graph, partition, _ = multimodal
    m = 8
    chain = chain_partition(graph, 8, m)
    graph_schedule, chain_schedule = schedule_for(partition, m), schedule_for(chain, m)
    graph_time = simulate(graph_schedule, partition.costs).makespan
    chain_time = simulate(chain_schedule, chain.costs).makespan
    assert graph_time <= 0.75 * chain_time
    assert max(peak_activation_bytes(partition, graph_schedule)) < max(
        peak_activation_bytes(chain, chain_schedule)
    )


def test_zero_bubble_dag_schedule_beats_dag_1f1b_on_the_multimodal_partition(multimodal):
    _, partition, _ = multimodal
    for m in (2, 2 * partition.depth()):
        one = schedule_for(partition, m)
        zb = schedule_for(partition, m, "dag-zb")
        r1, r2 = simulate(one, partition.costs), simulate(zb, partition.costs)
        assert r2.makespan <= r1.makespan and longest_span(zb, r2) <= longest_span(one, r1)
        assert max(peak_memory(zb)) <= max(peak_memory(one))
        if m >= 2 * partition.depth():
            assert r2.makespan < r1.makespan


# ----------------------------------------------------------------------------- from a jaxpr


def _two_branch_jaxpr(marked):
    import jax
    import jax.numpy as jnp

    import zbjax

    def branch(ws, x):
        for k, w in enumerate(ws):
            x = jnp.tanh(x @ w)
            if marked and k == 0:
                x = zbjax.stage_boundary(x)
        return x

    def loss(wa0, wa1, wb0, wb1, head, xa, xb):
        joined = jnp.concatenate([branch([wa0, wa1], xa), branch([wb0, wb1], xb)], -1)
        return jnp.mean((joined @ head) ** 2)

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    return jax.make_jaxpr(loss)(w, w, w, w, jnp.ones((16, 2)), x, x)


def test_op_graph_from_jaxpr_keeps_branches_apart_and_maps_equations_to_stages():
    closed = _two_branch_jaxpr(marked=False)
    traced = op_graph_from_jaxpr(closed, num_params=5, target_nodes=6)
    eqns = closed.jaxpr.eqns
    assert sorted(i for node in traced.node_equations for i in node) == list(range(len(eqns)))
    tree = series_parallel_tree(traced.graph, "error")
    assert tree.kind == "series" and tree.children[0].kind == "parallel"
    partition = graph_partition(traced.graph, 3, 4)
    assert partition.depth() == 2 and len(partition.edges) == 2  # two branches into the head
    stages = traced.equation_stages(partition)
    concat = next(i for i, e in enumerate(eqns) if e.primitive.name == "concatenate")
    first_dots = [i for i, e in enumerate(eqns) if e.primitive.name == "dot_general"][::2][:2]
    assert stages[concat] == partition.num_stages - 1
    assert stages[first_dots[0]] != stages[first_dots[1]]  # each branch on its own stage
    head = traced.graph.nodes[-1]
    assert head.weight_cost > 0 and head.param_bytes == 16 * 2 * 4


def test_op_graph_from_jaxpr_cuts_at_markers_only():
    closed = _two_branch_jaxpr(marked=True)
    traced = op_graph_from_jaxpr(closed, num_params=5, max_node_cost=1.0)
    eqns = closed.jaxpr.eqns
    markers = [i for i, e in enumerate(eqns) if e.primitive.name == "stage_boundary"]
    assert len(markers) == 2
    # Each marker starts its node; a tiny cost limit is ignored when markers are present:
    # branch a before / after its marker, branch b before, branch b after + concat + head.
    holder = {i: k for k, node in enumerate(traced.node_equations) for i in node}
    assert all(min(traced.node_equations[holder[m]]) == m for m in markers)
    assert len(traced.graph.nodes) == 4
    assert traced.graph.edges == ((0, 1), (1, 3), (2, 3))


def test_op_graph_from_jaxpr_joins_work_that_does_not_feed_the_loss_to_the_loss_node():
    """An aux metric computed after the loss made a node of its own, which GraphPipe could
    put in a last stage that does not feed the loss (an internal PartitionError at m = 1)."""
    import jax
    import jax.numpy as jnp

    def loss(w, x):
        h = jnp.tanh(x @ w)
        value = jnp.mean((jnp.tanh(h @ w) @ w) ** 2)
        return value, jnp.mean(jnp.sin(h) @ w)  # the aux, traced after the loss

    closed = jax.make_jaxpr(loss)(jnp.ones((8, 8)), jnp.ones((4, 8)))
    traced = op_graph_from_jaxpr(closed, num_params=1, max_node_cost=1.0)
    eqns = closed.jaxpr.eqns
    holder = {i: k for k, node in enumerate(traced.node_equations) for i in node}
    loss_node = holder[max(i for i, e in enumerate(eqns) if closed.jaxpr.outvars[0] in e.outvars)]
    sine = next(i for i, e in enumerate(eqns) if e.primitive.name == "sin")
    assert holder[sine] == loss_node == len(traced.graph.nodes) - 1
    assert all(node for node in traced.node_equations)  # none left empty
    assert sorted(holder) == list(range(len(eqns)))
