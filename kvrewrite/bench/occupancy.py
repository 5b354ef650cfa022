"""Registers, shared memory and programs per SM of a Triton kernel compiled for Hopper (sm_90), without a GPU.

    python -m kvrewrite.bench.occupancy          # the decode attention kernels' variants (clustered_attention, EMS),
                                                 # clustergen_fold's launches (registers, spills) and EMS's
                                                 # redundancy kernels (its two tiers, RECIP_NORMS or not,
                                                 # CENTRE_LIST's walk in both layouts)

Triton compiles for a named target on any machine (its wheel carries ptxas and cuobjdump): this reads the
registers a thread from the cubin (cuobjdump --dump-resource-usage) and the shared memory from the compile's
metadata, and derives how many programs one SM holds. The launch heuristics that depend on it
(clustered_attention.RESIDENT_PROGRAMS, RESIDENT_PROGRAMS_PENDING) are checked against it in
tests/kernels/test_clustered_attention.py, so a Triton upgrade that changes the code generation fails a test
instead of silently mis-sizing the grids. sm90_sass and sass_loops give a kernel's SASS and the instruction mix of
its tensor-core loops (what a warp executes per block, without a GPU; ncu_source.py reads where the time goes on
one). The register counts match what the same kernels report on an H200
(docs/bench/attention_notes.md, "Large batches"). Pointers are taken as 16-byte aligned and the
integers named in `aligned` as multiples of 16, as Triton specialises them at launch for the state's tensors.
"""
import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

# Hopper (compute capability 9.0): per SM 65536 32-bit registers and 228 KB of shared memory, at most 227 KB to one
# block and 1 KB reserved per block; registers are allocated per warp in units of 256 (CUDA occupancy calculator)
SM90 = dict(registers=65536, reg_unit=256, shared=228 * 1024, shared_per_block=227 * 1024, reserved=1024,
            max_blocks=32, max_threads=2048)


def programs_per_sm(regs_per_thread: int, shared_bytes: int, num_warps: int, sm: dict = SM90) -> int:
    """Programs (CTAs) of num_warps warps one SM holds at once, by registers, shared memory and threads."""
    per_warp = -(-regs_per_thread * 32 // sm["reg_unit"]) * sm["reg_unit"]
    by_regs = sm["registers"] // (per_warp * num_warps)
    by_shared = sm["shared"] // (shared_bytes + sm["reserved"]) if shared_bytes else sm["max_blocks"]
    by_threads = sm["max_threads"] // (32 * num_warps)
    if shared_bytes > sm["shared_per_block"]:
        return 0
    return min(by_regs, by_shared, by_threads, sm["max_blocks"])


def _sm90_compile(jit_fn, types: dict, constexprs: dict, aligned, num_warps: int, num_stages: int, sass: bool,
                  options: dict) -> tuple:
    """(registers a thread, shared bytes, the cuobjdump -sass listing or "", stack bytes a thread: its spills) of
    `jit_fn` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(jit_fn.fn).parameters)
    unknown = set(types) | set(constexprs) | set(aligned)
    unknown -= set(names)
    if unknown:
        raise ValueError(f"sm90_resources: {sorted(unknown)} are not arguments of {jit_fn.fn.__name__}")
    missing = [n for n in names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"sm90_resources: give a type or a constexpr value for {missing}")
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (types[n].startswith("*") or n in aligned)}
    src = ASTSource(fn=jit_fn, signature=signature, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages, **options))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        listing = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True,
                                 check=True).stdout if sass else ""
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    if regs is None or stack is None:
        raise RuntimeError(f"sm90_resources: no register or stack size in cuobjdump's output:\n{usage}")
    return int(regs.group(1)), int(compiled.metadata.shared), listing, int(stack.group(1))


def sm90_resources(jit_fn, types: dict, constexprs: dict, aligned=(), num_warps: int = 4, num_stages: int = 2,
                   instructions: bool = False, **options) -> tuple:
    """(registers a thread, shared bytes) of `jit_fn` compiled for sm_90; with instructions, (registers, shared bytes,
    static SASS instructions: a size, not a time) from the same compile. types: Triton type of every argument that
    is not a constexpr ("*bf16", "i32", "fp32", ...); constexprs: name -> value; aligned: integer arguments taken
    as multiples of 16 (pointers always are 16-byte aligned)."""
    regs, shared, listing, _ = _sm90_compile(jit_fn, types, constexprs, aligned, num_warps, num_stages, instructions,
                                             options)
    if not instructions:
        return regs, shared
    return regs, shared, len(sass_instructions(listing))


def sm90_sass(jit_fn, types: dict, constexprs: dict, aligned=(), num_warps: int = 4, num_stages: int = 2,
              **options) -> str:
    """The SASS listing (cuobjdump -sass) of `jit_fn` compiled for sm_90 as sm90_resources compiles it: what
    sass_loops reads. Two forms of a kernel that should compile alike can be compared instruction for instruction
    (sass_instructions without the addresses)."""
    return _sm90_compile(jit_fn, types, constexprs, aligned, num_warps, num_stages, True, options)[2]


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")


def sass_instructions(listing: str) -> list:
    """(address, text) of every instruction of a cuobjdump -sass listing, in order (the encodings dropped)."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_SASS_LINE.match, listing.splitlines()) if m]


def _opcode(text: str) -> str:
    """The opcode's first name of an instruction (its predicate and modifiers dropped): 'HGMMA', 'MUFU', ..."""
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def sass_loops(listing: str, marker: str = "HGMMA") -> list:
    """The loops of a SASS listing (from a backward branch's target to the branch) that hold an instruction whose
    opcode is `marker` (Hopper's tensor-core product by default): dicts of start, end (addresses), instructions
    (static: a loop's branches inside take only some of them) and opcodes (name -> count), shortest first. Where
    a kernel's time goes is read off the hottest such loop: stop 56's fold and redundancy changes began from it
    (docs/bench.md "Stop 56 runs")."""
    ins = sass_instructions(listing)
    loops = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m is None or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        ops = [_opcode(t) for t in body]
        if marker in ops:
            loops.append(dict(start=int(m.group(1), 16), end=addr, instructions=len(body),
                              opcodes=dict(sorted(Counter(ops).items(), key=lambda kv: -kv[1]))))
    return sorted(loops, key=lambda lp: lp["instructions"])


# the attention kernels' float scalars; every other non-pointer, non-constexpr argument is an int32
FLOAT_ARGS = ("qk_scale", "softcap_log2", "pend_scale", "s_scale")


def _argument_types(kernel, pointers: dict, constexprs: dict) -> dict:
    """sm90_resources' `types` of `kernel`: the pointers' given types, fp32 for FLOAT_ARGS, int32 otherwise."""
    return {n: pointers.get(n, "fp32" if n in FLOAT_ARGS else "i32")
            for n in inspect.signature(kernel.fn).parameters if n not in constexprs}


def attention_decode_resources(pending: bool, split: bool, head_dim: int = 128, dtype: str = "bf16") -> tuple:
    """sm90_resources of clustered_attention's decode kernel as launch_forward launches it for a decode step of
    the Llama layout (past_only, no window; with observed_attention's pending rows: deferring, 3 entries of 4
    heads), and its launch's warps and stages."""
    from kvrewrite.kernels import clustered_attention as ca

    cfg = ca._launch_config(1, 8, 4, 1, 6656, head_dim, 132, itemsize=2 if dtype in ("bf16", "fp16") else 4)
    kernel = ca._clustered_attention_fwd_kernel
    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "BIAS": "*fp32", "POS": "*i64", "CPOS": "*i64",
                "OUT": "*fp32" if split else f"*{dtype}", "M_PART": "*fp32", "L_PART": "*fp32", "LOGITS": "*fp32",
                "LSE": "*fp32", "PEND_Q": "*fp32", "PEND_LSE": "*fp32", "SCORE": "*fp32", "FILL": "*i64"}
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SPLIT=split,
                      SKIP_UNSEEN=cfg["skip_unseen"], LOAD_POS=False, HAS_WINDOW=False, CAUSAL_SKIP=True,
                      SOFTCAP=False, WRITE_LOGITS=False, WRITE_LSE=pending and not split, PENDING=pending,
                      NPEND=3 if pending else 1, DEFER=pending, SAVE_Q=pending and not split, PDL=True)
    # unit strides along the innermost dimension become constexprs at launch (Triton specialises 1)
    constexprs.update({n: 1 for n in ("stride_qd", "stride_kd", "stride_vd", "stride_bc", "stride_pc", "stride_sc",
                                      "stride_fh")})
    types = _argument_types(kernel, pointers, constexprs)
    aligned = [n for n in types if n.startswith("stride") or n in ("C", "slots_per_split")]
    regs, shared = sm90_resources(kernel, types, constexprs, aligned, cfg["num_warps"], cfg["num_stages"],
                                  launch_pdl=True)
    return regs, shared, cfg["num_warps"]


def expanded_decode_resources(split: bool, write_s: bool, head_dim: int = 128, dtype: str = "bf16",
                               narrow: bool = False) -> tuple:
    """sm90_resources of EMS's expanded-attention kernel (kernels/_expanded_attention_kernels.py) as
    launch_expanded_forward launches it for a decode step of the Llama layout (past_only; write_s: the decode fold's
    S output; narrow: expanded_attention.NARROW's form), and its launch's warps."""
    from kvrewrite.kernels import _expanded_attention_kernels as xk
    from kvrewrite.kernels import expanded_attention as xa

    cfg = xa._launch_config(1, 8, 4, 1, 6656, head_dim, 132, 2 if dtype in ("bf16", "fp16") else 4, narrow=narrow)
    kernel = xk._expanded_attention_fwd_kernel
    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "BIAS": "*fp32", "POS": "*i64", "CPOS": "*i64",
                "ESTART": "*i32", "LUT": "*i32", "KSCALE": "*fp32", "SFILL": "*i64",
                "OUT": "*fp32" if split else f"*{dtype}", "M_PART": "*fp32", "L_PART": "*fp32", "LSE": "*fp32",
                "S_OUT": "*fp32"}
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_J=cfg["block_j"],
                      SPLIT=split, LOAD_POS=False, SOFTCAP=False, WRITE_S=write_s, GATHER=cfg["gather"],
                      SCATTER=cfg["scatter"], GM=cfg["gm"], stride_qd=1, stride_kd=1, stride_vd=1)
    types = _argument_types(kernel, pointers, constexprs)
    regs, shared = sm90_resources(kernel, types, constexprs, [n for n in types if n.startswith("stride")],
                                  cfg["num_warps"], cfg["num_stages"])
    return regs, shared, cfg["num_warps"]


def clustergen_fold_resources(head_dim: int = 128, dtype: str = "bf16") -> dict:
    """{kernel name: (registers a thread, stack bytes a thread, warps)} of clustergen_fold's five launches that read
    keys (kernels/_clustergen_fold_kernels.py) compiled for sm_90 as triton_clustergen_fold launches them by default
    at the Llama layout's 32k budget 0.2 (C 8633): D specialised (a multiple of 16), every other integer not. A
    stack above 0 is a spill (docs/bench.md "Stop 63 runs": unspecialised D, 168-255 registers and the
    calibration's 96-byte stack)."""
    from kvrewrite.kernels import _clustergen_fold_kernels as kk

    pointers = dict(K=f"*{dtype}", V=f"*{dtype}", REP=f"*{dtype}", XK=f"*{dtype}", XV=f"*{dtype}", BIAS="*fp32",
                    POS="*i64", XP="*i64", ROLE="*i8", FILL="*i64", BUDGET="*i64", NCL="*i64", NSEEN="*i64",
                    NFORCED="*i64", MU="*fp32", DELTA="*fp32", D2="*fp32", W="*fp32", PD="*fp32", P="*fp64")
    INT32_POINTERS = ("FS", "KS", "INFO", "COUNT", "JC", "ASSIGN", "JO", "JL", "JR", "NL", "PI")
    cfg = kk.launch_config(8633, head_dim)  # the launcher's defaults at C 8633
    out = {}
    for launch, meta in cfg.items():
        constexprs = dict(meta)
        warps = constexprs.pop("num_warps", 4)  # Triton's default where the launcher passes none
        kernel = getattr(kk, f"_cg_{launch}_kernel")
        types = {n: pointers.get(n, "*i32" if n in INT32_POINTERS else "i64" if n == "hbase" else "i32")
                 for n in inspect.signature(kernel.fn).parameters if n not in constexprs}
        regs, _, _, stack = _sm90_compile(kernel, types, constexprs, ("D",), warps, 3, False, {})
        out[kernel.fn.__name__] = (regs, stack, warps)
    return out


def redundancy_resources(recip: bool, big: bool, head_dim: int = 128, dtype: str = "bf16",
                         listed: bool = False, rows: bool | None = None) -> tuple:
    """(registers, shared bytes, warps, static SASS instructions) of ems_redundancy's main kernel as its launcher
    launches it at batch 8 of the Llama layout (4 centre splits): big, the tier of 128-row TBM blocks (a prefill
    chunk's compression), else the 32-row one; recip, RECIP_NORMS' form; listed, CENTRE_LIST's walk of the listed
    centres (RECIP_NORMS' form; the big tier's launch by default), as [centres, TBM] where rows (default
    LIST_CENTRE_ROWS) else [TBM, centres]."""
    from kvrewrite.kernels import ems_redundancy as er

    bt, warps = (er.BIG_BLOCK_T, er.BIG_WARPS) if big else (er.BLOCK_T, 4)
    if listed:
        kernel = er._redundancy_listed_kernel
        pointers = {"A": f"*{dtype}", "V": f"*{dtype}", "TL": "*i32", "NT": "*i32", "CL": "*i32", "NC": "*i32",
                    "IA": "*fp32", "IV": "*fp32", "PB": "*fp32", "PA": "*i32"}
        constexprs = dict(S=4, IEEE=dtype == "fp32", BT=bt, BN=er.LIST_BLOCK_N, BLOCK_D=max(16, head_dim),
                          ROWS=er.LIST_CENTRE_ROWS if rows is None else rows)
        aligned, stages = ("C", "D"), er.LIST_STAGES
    else:
        kernel = er._redundancy_kernel
        pointers = {"A": f"*{dtype}", "V": f"*{dtype}", "CLS": "*i32", "TL": "*i32", "NT": "*i32", "PB": "*fp32",
                    "PA": "*i32"}
        constexprs = dict(S=4, IEEE=dtype == "fp32", BT=bt, BN=er.BLOCK_N, BLOCK_D=max(16, head_dim), RECIP=recip)
        aligned, stages = ("C", "D", "CS"), 2
    types = _argument_types(kernel, pointers, constexprs)
    regs, shared, n = sm90_resources(kernel, types, constexprs, aligned, warps, stages, instructions=True)
    return regs, shared, warps, n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    for pending in (False, True):
        for split in (False, True):
            regs, shared, warps = attention_decode_resources(pending, split)
            print(f"decode attention, pending rows {pending!s:5}, split {split!s:5}: {regs} registers, {shared} B shared, "
                  f"{warps} warps: {programs_per_sm(regs, shared, warps)} programs per SM", flush=True)
    for narrow in (True, False):  # expanded_attention.NARROW's form (the default) and the full width
        for write_s in (False, True):
            for split in (False, True):
                regs, shared, warps = expanded_decode_resources(split, write_s, narrow=narrow)
                print(f"EMS expanded attention, {'narrow' if narrow else 'full width'}, S written {write_s!s:5}, "
                      f"split {split!s:5}: {regs} registers, {shared} B shared, {warps} warps: "
                      f"{programs_per_sm(regs, shared, warps)} programs per SM", flush=True)
    for name, (regs, stack, warps) in clustergen_fold_resources().items():  # bf16, D 128
        print(f"clustergen_fold {name}: {regs} registers, {stack} B stack (spills), {warps} warps", flush=True)
    for big in (True, False):  # ems_redundancy's two tiers, R by division (the default) and RECIP_NORMS' form
        for recip in (False, True):
            regs, shared, warps, n = redundancy_resources(recip, big)
            print(f"EMS redundancy, {'128' if big else '32'}-row blocks, {'RECIP_NORMS' if recip else 'divisions'}: "
                  f"{regs} registers, {shared} B shared, {warps} warps: {programs_per_sm(regs, shared, warps)} "
                  f"programs per SM, {n} static SASS instructions", flush=True)
    for rows in (True, False):  # CENTRE_LIST: the big tier's launch, R as [centres, TBM] (the default) or not
        regs, shared, warps, n = redundancy_resources(True, True, listed=True, rows=rows)
        print(f"EMS redundancy, 128-row blocks, the listed centres (CENTRE_LIST), R as "
              f"{'[centres, TBM]' if rows else '[TBM, centres]'}: {regs} registers, {shared} B shared, {warps} warps: "
              f"{programs_per_sm(regs, shared, warps)} programs per SM, {n} static SASS instructions", flush=True)


if __name__ == "__main__":
    main()
