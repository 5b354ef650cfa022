"""Quality measurements shared by the tests, the CLI and the evaluation."""
import math

import torch


@torch.no_grad()
def continuation_nll(rw, context_ids: torch.Tensor, target_ids: torch.Tensor, progress: bool = False) -> float:
    """Mean negative log-likelihood (nats/token) of `target_ids` [B, m] teacher-forced after `context_ids` [B, n].

    The context is prefilled (and compressed, for a compressing method) with the budget computed
    for n + m tokens; the target is then fed one decode step at a time, so decode-time
    re-compression is part of what is measured.
    """
    m = target_ids.shape[1]
    logits = rw.prefill(context_ids, max_new_tokens=m, progress=progress)
    return teacher_forced_nll(rw, logits, target_ids, progress=progress, what="continuation_nll")


@torch.no_grad()
def teacher_forced_nll(rw, logits: torch.Tensor, target_ids: torch.Tensor, progress: bool = False,
                       what: str = "teacher_forced_nll") -> float:
    """Mean NLL (nats/token) of `target_ids` [B, m] fed one decode step at a time after a prefill that
    returned `logits` [B, V]; `what` names the caller in the error raised on a non-finite result."""
    from tqdm.auto import tqdm

    m = target_ids.shape[1]
    target_ids = target_ids.to(logits.device)
    total = torch.zeros((), dtype=torch.float64)
    for j in tqdm(range(m), desc="score", unit="tok", disable=not progress):
        logp = torch.log_softmax(logits.double(), dim=-1)
        total += -logp.gather(1, target_ids[:, j : j + 1]).sum().cpu()
        if j < m - 1:
            logits = rw.decode_step(target_ids[:, j])
    value = float(total) / (m * target_ids.shape[0])
    if not math.isfinite(value):
        raise FloatingPointError(f"{what}: non-finite NLL {value}")
    return value
