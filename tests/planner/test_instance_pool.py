"""The planner's view of the prefill pool: GetGroup keeps groups inside as few nodes as it can
(§5.1), Eq. (2) advances every queue, and a chosen plan is booked onto the pool."""

from __future__ import annotations

from gearshift.operator.planner.instance_pool import Pool, get_group


def test_a_first_group_that_fits_one_node_takes_the_node_with_the_shortest_sth_wait():
    #            node 0                node 1
    pool = Pool.uniform([0.0, 0.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0], per_node=4)
    assert get_group(pool, (), 2) == (0, 1)  # node 0's 2nd shortest wait is 0 < 1
    assert set(get_group(pool, (), 4) or ()) == {4, 5, 6, 7}  # node 0's 4th is 5 > 1
    # One node's instances even when a cross-node pick would wait less: 3 on node 1 (wait 1),
    # not {0, 1} + one of node 1.
    assert set(get_group(pool, (), 3) or ()) == {4, 5, 6}


def test_a_group_larger_than_a_node_takes_whole_nodes_then_the_best_node_for_the_rest():
    queues = [3.0] * 4 + [1.0] * 4 + [0.0, 0.0, 9.0, 9.0]  # nodes 0, 1, 2
    pool = Pool.uniform(queues, per_node=4)
    group = get_group(pool, (), 6) or ()
    # Node 1 frees up first as a whole (max 1 < 3 < 9); the other 2 come from node 2 (2nd
    # shortest wait 0), not from node 0.
    assert set(group) == {4, 5, 6, 7, 8, 9}
    assert pool.wait(group) == 1.0


def test_a_group_grows_inside_its_nodes_before_it_crosses_to_another():
    pool = Pool.uniform([2.0, 2.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0], per_node=4)
    # Node 1 is idle, but the chunk's history lives on node 0: extend there first, shortest first.
    assert get_group(pool, (0, 1), 3) == (0, 1, 3)
    assert get_group(pool, (0, 1), 4) == (0, 1, 3, 2)
    six = get_group(pool, (0, 1), 6) or ()
    assert six[:4] == (0, 1, 3, 2) and set(six[4:]) <= {4, 5, 6, 7}
    # A group never shrinks, and never exceeds the pool.
    assert get_group(pool, (0, 1, 3), 2) is None
    assert get_group(pool, (), 9) is None
    assert get_group(pool, (0, 1), 2) == (0, 1)


def test_eq_2_advances_every_queue_and_frees_instances_at_zero():
    pool = Pool.uniform([0.5, 3.0, 1.0, 4.0], per_node=2)
    later = pool.advance(1.5)
    assert dict(later.queue) == {0: 0.0, 1: 1.5, 2: 0.0, 3: 2.5}
    assert pool.queue[1] == 3.0, "the old pool is unchanged"
    # Each node's instances stay sorted shortest-wait first; newly free ones by id.
    assert later.by_node == {0: [(0, 0.0, 0), (0, 1.5, 1)], 1: [(1, 0.0, 2), (1, 2.5, 3)]}
    # Restricting keeps only the group's instances, with their queues.
    inner = pool.restrict((1, 3))
    assert dict(inner.queue) == {1: 3.0, 3: 4.0} and get_group(inner, (), 3) is None
    # Instances that become free together are taken in id order, as in a fresh pool.
    tied = Pool.uniform([1.0, 0.5], per_node=2)
    assert tied.by_node == {0: [(0, 0.5, 1), (0, 1.0, 0)]}
    assert tied.advance(2.0).by_node == Pool.uniform([0.0, 0.0], 2).by_node


def test_a_committed_plan_keeps_each_instance_busy_until_its_last_chunk_ends():
    pool = Pool.uniform([0.0, 0.0, 2.0, 0.0], per_node=4)
    booked = pool.commit([((0, 1), 1.5), ((0, 1, 2, 3), 4.0)])
    assert dict(booked.queue) == {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0}
    booked = pool.commit([((0,), 1.0)])
    assert dict(booked.queue) == {0: 1.0, 1: 0.0, 2: 2.0, 3: 0.0}
