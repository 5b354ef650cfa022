"""Where a CUDA call of an op runs its PyTorch reference instead of its Triton kernels, the op reports it here.

The reference is correct and much slower (tens of times for the compression ops): a state past a kernel's size
limit, an input layout the kernel does not take, or kernels not yet checked on a GPU. Each op's CUDA path calls
`reference_fallback` when it takes the reference; the message is logged once per distinct text and the op is
recorded, so `kvrewrite bench` writes into each row which ops ran their reference in it and says so in its
output. Why: in stop 41, EMS's merge ran its reference at 32k and batch 8 (R = 36836 slots, past its kernels'
32768 then) for a whole benchmark run, and its one log line went unseen; the row read 1035 ms a compressing step.
"""
import logging

logger = logging.getLogger("kvrewrite.kernels")

_SEEN: dict = {}  # op -> the first message since the last clear_reference_fallbacks()
_LOGGED: set = set()


def reference_fallback(fmt: str, *args) -> None:
    """Report that this call runs the op's reference on CUDA. fmt % args is the message; it starts with the op's
    name and a colon ("ems_merge: ..."), which names the op in the record."""
    msg = fmt % args if args else fmt
    op = msg.split(":", 1)[0]
    _SEEN.setdefault(op, msg)
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.warning("%s", msg)


def reference_fallbacks() -> dict:
    """{op: its first message} of every op that ran its reference on CUDA since the last clear."""
    return dict(_SEEN)


def clear_reference_fallbacks() -> None:
    _SEEN.clear()
