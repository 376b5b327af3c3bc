"""Which decode batch sizes get a CUDA graph (pure function; the graphs themselves: tests/gpu)."""

from pagoda_daemon.worker.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 4 + 16
    # every batch size from 1 to the maximum has a graph no more than 15 rows larger
    for n in range(1, 257):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 16
