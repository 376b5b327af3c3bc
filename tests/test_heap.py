import gc

from pagoda_daemon.heap import freeze_startup_heap


def test_the_startup_heap_leaves_the_collectors_generations():
    class Node:
        pass

    keep = [Node() for _ in range(1000)]  # tracked objects alive at "start-up"
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        assert not any(gc.is_tracked(n) and n in gc.get_objects(generation=2) for n in keep[:3])
    finally:
        gc.unfreeze()
