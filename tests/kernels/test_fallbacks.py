"""kernels/_fallbacks.py: the record of ops that ran their PyTorch reference on CUDA, which `kvrewrite bench` writes
into each row (and prints), logged once per message."""
import logging

from kvrewrite.bench.e2e import format_row
from kvrewrite.kernels import _fallbacks as fb


def test_records_each_op_once_and_logs_each_message_once(caplog):
    fb.clear_reference_fallbacks()
    with caplog.at_level(logging.WARNING, logger="kvrewrite.kernels"):
        for _ in range(3):
            fb.reference_fallback("ems_merge: CUDA runs the tensor reference (R=%d)", 36836)
        fb.reference_fallback("ems_merge: CUDA runs the tensor reference (R=%d)", 40000)
        fb.reference_fallback("evict_by_score: no Triton kernel for this state (C=%d)", 40000)
    assert fb.reference_fallbacks() == {"ems_merge": "ems_merge: CUDA runs the tensor reference (R=36836)",
                                        "evict_by_score": "evict_by_score: no Triton kernel for this state (C=40000)"}
    assert [r.getMessage() for r in caplog.records].count("ems_merge: CUDA runs the tensor reference (R=36836)") == 1
    assert len(caplog.records) == 3
    fb.clear_reference_fallbacks()
    assert fb.reference_fallbacks() == {}


def test_a_bench_row_names_the_ops_that_ran_their_reference():
    row = dict(system="ems", context=32768, batch=8, ms_per_token=41.8, tok_per_s=191.3, floor_ms=5.55,
               ratio_to_floor=7.54, kv_bytes=2**34, ms_plain_step_median=9.7, ms_compress_step_mean=1035.5,
               reference_fallbacks={"ems_merge": "ems_merge: CUDA runs the tensor reference (R=36836)"})
    assert "SLOW PATH: ran the PyTorch reference of ems_merge" in format_row(row)
    del row["reference_fallbacks"]
    assert "SLOW PATH" not in format_row(row)
