"""The SASS readers of the benchmarks: occupancy.sass_loops on a cuobjdump listing and ncu_source on an Nsight
Compute source-page export, both on small hand-written inputs of the real formats (no GPU, no Triton)."""
import pytest

from kvrewrite.bench import ncu_source, occupancy

# cuobjdump -sass's layout: an address comment, the instruction, its encoding comment
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x00000a0000017a02 */
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;  /* 0x0 */
        /*0020*/              @P0  MUFU.EX2 R2, R2 ;                          /* 0x0 */
        /*0030*/                   MUFU.EX2 R3, R3 ;                          /* 0x0 */
        /*0040*/              @!P1 BRA 0x10 ;                                 /* 0x0 */
        /*0050*/                   FADD R4, R4, R5 ;                          /* 0x0 */
        /*0060*/                   BRA 0x50 ;                                 /* 0x0 */
        /*10000*/                  EXIT ;                                     /* 0x0 */
"""


def test_sass_loops_find_the_tensor_core_loop_and_its_mix():
    """The loop from a backward branch's target to the branch, kept only with an HGMMA in it; opcodes counted
    without predicates or modifiers; five-digit addresses read too."""
    ins = occupancy.sass_instructions(LISTING)
    assert [a for a, _ in ins] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x10000]
    loops = occupancy.sass_loops(LISTING)
    assert loops == [dict(start=0x10, end=0x40, instructions=4, opcodes={"MUFU": 2, "HGMMA": 1, "BRA": 1})]
    assert [lp["start"] for lp in occupancy.sass_loops(LISTING, marker="FADD")] == [0x50]


HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait",'
          '"stall_barrier","stall_wait (Not Issued)"')
ROWS = ['"0x1","  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","30","100","20","10","5"',
        '"0x2","  @P0 MUFU.EX2 R2, R2","50","100","40","10","7"',
        '"0x3","  ISETP.LT.AND P0, PT, R1, R2, PT","20","60","20","0","1"',
        '"0x4","  EXIT","0","4","0","0","0"']


def test_ncu_source_summary(tmp_path):
    """Stall shares of the samples (the Not Issued columns left out), opcode shares by executions and samples, the
    hot path (the most executed instructions), ncu's log lines before the table skipped."""
    path = tmp_path / "k.csv"
    path.write_text("\n".join(["==PROF== Connected to process 1", '"Kernel Name","k",', HEADER, *ROWS]))
    s = ncu_source.summary(ncu_source.read(str(path)), top=3)
    assert s["samples"] == 100 and s["stalls"] == [("wait", 80.0), ("barrier", 20.0)]
    assert s["executed"] == [("HGMMA", 37.9), ("MUFU", 37.9), ("ISETP", 22.7)]
    assert s["sampled"][0] == ("MUFU", 50.0)
    assert (s["hot_count"], s["hot_path"], dict(s["hot_mix"])) == (100, 2, {"HGMMA": 1, "MUFU": 1})
    assert s["hottest"][0] == (50, 100, "@P0 MUFU.EX2 R2, R2")
    ncu_source.main([str(path), "--top", "2"])
    bad = tmp_path / "bad.csv"
    bad.write_text("no table here\n")
    with pytest.raises(ValueError, match="--page source"):
        ncu_source.read(str(bad))
