"""Which thread runs the model's parallel loops: the step thread, and no other.

OpenMP (torch's ``libgomp``, which the native kernels share) keeps a pool of worker threads for
every thread that ever started a parallel loop, and counts every pool's workers against the
machine's CPUs. Once there are more than CPUs, each worker spins only briefly when a loop ends
and then sleeps, so every later loop pays for waking it. A server whose main thread loaded the
model with N threads and whose step thread then steps it with N more is past that count wherever
N is every core (torch's default): on a 2-core machine its one-stream step took 32 ms against 25
ms for the same engine stepped on the main thread, and a 256x256 matmul 290 us against 190.

So the thread that starts the step thread gives its pool back and runs one thread from then on
(:func:`leave_parallel_loops`), and the step thread takes the count the other had
(:func:`take_parallel_loops`). Where the OpenMP runtime has no ``omp_pause_resource_all``
(OpenMP 5.0), the pool stays and only the counts move.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads and everything they hold


def leave_parallel_loops() -> int:
    """Give the calling thread's OpenMP pool back and run it on one thread; the count it had."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pause = _pause()
    if pause is not None and pause(OMP_PAUSE_HARD) != 0:
        log.warning("the OpenMP runtime kept this thread's pool (omp_pause_resource_all failed)")
    return threads


def take_parallel_loops(threads: int) -> None:
    """Run the calling thread's parallel loops on ``threads`` threads (call it on the step thread)."""
    torch.set_num_threads(max(1, threads))


def _pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the runtime torch loaded, if it has one."""
    try:
        function = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return function
