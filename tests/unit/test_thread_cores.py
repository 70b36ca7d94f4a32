"""thread_cores: cores per thread between two /proc readings."""
from disagg.devcluster.procs import thread_cores, thread_cpu_seconds


def test_cores_are_the_cpu_delta_over_the_window_and_new_threads_count_whole():
    before = {(1, 1): ("main", 10.0), (1, 2): ("gone", 3.0)}
    after = {(1, 1): ("main", 11.0), (1, 3): ("new", 0.5)}
    assert thread_cores(before, after, elapsed=2.0) == {(1, 1): ("main", 0.5), (1, 3): ("new", 0.25)}


def test_reads_this_process_threads():
    import os
    reading = thread_cpu_seconds([os.getpid()])
    assert (os.getpid(), os.getpid()) in reading
    assert all(cores >= 0 for _, cores in thread_cores(reading, thread_cpu_seconds([os.getpid()]), 1.0).values())
