"""CUDA-graph helpers shared by the kernel benchmarks.

A capture must launch nothing new: Triton compiles, cuBLAS picks workspaces and the caching allocator grows on
the first calls, so torch.cuda.graphs asks for warm-up calls on a side stream first (warm_up); capture then
records one call of `fn` (capture).
"""
import torch


def warm_up(fn, times: int = 1) -> None:
    """Call fn() `times` times on a side stream, then wait for it on the current stream and the device."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fn, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of fn() (warm it up first), in the memory pool `pool` if given."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


def timed_replays_us(graph: torch.cuda.CUDAGraph, replays: int, per: int = 1, before=None) -> list:
    """Microseconds of each of `replays` replays of `graph` (CUDA events around the replay alone), divided by `per`
    (the calls the graph holds); `before()`, if given, runs before each replay, outside the timed span."""
    times = []
    for _ in range(replays):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return times


def replay_us(call, reset, replays: int = 12, skip: int = 2) -> float:
    """Median microseconds of one CUDA-graph replay of `call` (warmed up by the caller), `reset()` restoring the
    inputs before the capture and before each replay (an in-place op must see the same state every time); a 1 ms
    device sleep before each timed replay keeps the launch off the critical path; the first `skip` are dropped."""
    import statistics

    def before():
        reset()
        torch.cuda._sleep(1_000_000)

    reset()
    graph = capture(call)
    return statistics.median(timed_replays_us(graph, replays, before=before)[skip:])
