"""A batch-2 prompt on the tiny models (row 1 left-padded) and a prefill + decode loop, shared by the method tests
that compare logits step by step (ClusterKV, KVMerger)."""
import torch

CHUNK = 8
N_PROMPT, PAD_ROW1 = 21, 4  # left-padded to 3 chunks of 8; row 1 has 4 more padding tokens


def prompt(n=N_PROMPT, seed=1):
    """(ids, mask) [2, n]: random tokens, the first PAD_ROW1 of row 1 padding."""
    ids = torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    return ids, mask


def run(rw, ids, mask, steps, fed=None):
    """Prefill + `steps` decode steps (greedy, or feeding `fed` [2, steps]); returns (logits per step, fed)."""
    logits = [rw.prefill(ids, mask, max_new_tokens=steps + 1)]
    toks = []
    for i in range(steps):
        toks.append(logits[-1].argmax(-1) if fed is None else fed[:, i])
        logits.append(rw.decode_step(toks[-1]))
    return torch.stack(logits, 1), torch.stack(toks, 1)
