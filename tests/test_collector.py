"""`core.collector.fewer_collections`: the collector's state inside a block and after it."""

import gc
import weakref

from opgraph.core.collector import THRESHOLDS, fewer_collections


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_thresholds_are_raised_inside_and_restored_after():
    before = gc.get_threshold()
    with fewer_collections():
        inside = gc.get_threshold()
    assert all(i >= max(b, t) for i, b, t in zip(inside, before, THRESHOLDS))
    assert gc.get_threshold() == before


def test_what_lived_before_is_frozen_inside_and_unfrozen_at_the_outermost_end():
    assert gc.get_freeze_count() == 0
    with fewer_collections():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [_Node() for _ in range(100)]
        with fewer_collections():  # an inner block freezes what the outer one made too
            assert gc.get_freeze_count() >= frozen + len(made)
        assert gc.get_freeze_count() >= frozen + len(made)  # still, until the outer end
    assert gc.get_freeze_count() == 0


def test_cyclic_garbage_frozen_inside_is_collected_after():
    node = _Node()
    gone = weakref.ref(node)
    with fewer_collections():
        del node
        gc.collect()
        assert gone() is not None  # frozen: no collection inside frees it
    gc.collect()
    assert gone() is None


def test_a_caller_that_froze_objects_of_its_own_keeps_them_frozen():
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        with fewer_collections():
            assert gc.get_freeze_count() == mine
        assert gc.get_freeze_count() == mine
    finally:
        gc.unfreeze()
