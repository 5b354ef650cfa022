"""Runs a CUDA op in memory filled with NaN first, for the GPU kernel tests: an output element the kernel
forgets to write then fails the comparison."""
import torch


def poisoned(fn, nbytes):
    """fn() (a tensor or a tuple of tensors) with every CUDA allocation inside it taken from memory filled
    with 0xFF bytes (NaN in fp16, bf16 and fp32): a private pool of at least 2 * nbytes is filled and freed
    first. Returns copies made outside the pool."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        large = torch.full((2 * nbytes + (32 << 20),), 255, dtype=torch.uint8, device="cuda")
        small = [torch.full((1 << 20,), 255, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del large, small
        probe = torch.empty(1 << 16, dtype=torch.float32, device="cuda")
        assert probe.isnan().all(), "poisoning the allocator failed: the test would not see unwritten outputs"
        del probe
        out = fn()
    result = out.clone() if isinstance(out, torch.Tensor) else tuple(o.clone() for o in out)
    del out, pool
    torch.cuda.empty_cache()  # hands the freed pool's memory back
    return result
