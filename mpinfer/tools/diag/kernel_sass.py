"""A weight-only matmul config's compiled main loop, read on any machine (no GPU needed):

    python -m mpinfer.tools.diag.kernel_sass "swap n128 k64 split1 pf0 magic6 w8 s3 m256" \
        [--bits 8] [--arch 90]
    python -m mpinfer.tools.diag.kernel_sass --attention fp16 int8 int8-biased   (the decode
        attention's loop over those caches)

Triton compiles the kernel for the target (default sm_90a: the H100 and H200) with its pointers
and strides specialized as a real launch specializes them (16-byte aligned, multiples of 16:
without that no load is asynchronous and nothing is pipelined), the ptxas of Triton's wheel
assembles it and cuobjdump disassembles it. Printed: registers a thread, the stack (spills),
shared memory, and the instructions of the main loop (the tensor-core ops', else the longest),
by opcode (local loads and stores there would be spills inside the loop). Round 8 found the
swap loop's byte re-packing this way (docs/performance.md). Use the GPU machine's Triton
version: another version compiles other code.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ...model.kernels import tuning

# Pointer arguments' element types (int4: packed bytes, fp16 scales and offsets, magic7's fp32
# group sums of x).
_POINTERS = {8: {"w_ptr": "*i8", "s_ptr": "*fp32"},
             4: {"w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16",
                 "xs_ptr": "*fp32"}}  # fmt: skip
_ALIGNED = ("_ptr", "N", "K", "stride")  # what a launch's values make multiples of 16


def compile_config(
    config: str,
    *,
    bits: int = 8,
    arch: int = 90,
    group: int = 128,
    rows: int = tuning.SINGLE_TILE,
):
    """The compiled kernel (Triton's CompiledKernel) of `config` for GPUs of `arch`, fp16
    activations, a bias, no GeLU or residual, whole K tiles, for a launch of `rows` (a config
    without BLOCK_M takes the rows' bucket's tile)."""
    from ...model.kernels import w4a16, w8a16, w8a16_tma

    kw, warps, stages = tuning.parse(config)
    kernel = w8a16_tma._w8a16_tma if kw["TMA"] else (w8a16._w8a16, w4a16._w4a16)[bits == 4]
    kw = dict(kw, BLOCK_M=tuning.block_m(kw, rows), BLOCK_K=kw["BLOCK_K"]
              if bits == 8 else group)  # fmt: skip
    names = list(inspect.signature(kernel.fn).parameters)
    regs = kw.pop("MAXNREG")  # a launch option ("r80"), not a meta-parameter
    fixed = dict(HAS_BIAS=True, ACT=False, HAS_RES=False, EVEN_K=True, STAGES=stages,
                 LINES=w4a16.LINES, ABLATE=0,  # the one-row int4 loop's (MPINFER_INT4_LINES)
                 SPLIT=kw["split_k"] > 1,  # the tma loops compile apart with a split
                 **{k: v for k, v in kw.items() if k != "split_k"})  # fmt: skip
    fixed = {k: v for k, v in fixed.items() if k in names}
    ptrs = _POINTERS[bits]
    sig = {n: "constexpr" if n in fixed else ptrs.get(n, "*fp32" if n.startswith(("ws", "cnt"))
           else "*fp16") if n.endswith("_ptr") else "i32" for n in names}  # fmt: skip
    if "cnt_ptr" in sig:
        sig["cnt_ptr"] = "*i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and any(a in n for a in _ALIGNED)}  # fmt: skip
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in fixed.items()},
                    attrs=attrs)  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages,
                                       **({"maxnreg": regs} if regs else {})))  # fmt: skip


def _disassemble(compiled) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel, by the cuobjdump of Triton's wheel."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"  # assembled by Triton's own ptxas
        cubin.write_bytes(compiled.asm["cubin"])
        return tuple(
            subprocess.run([cuobjdump, flag, cubin], capture_output=True, text=True, check=True)
            .stdout for flag in ("-res-usage", "-sass")
        )  # fmt: skip


def opcodes(config: str, **kw) -> list[str]:
    """The compiled kernel's SASS opcodes in program order (compile_config's arguments)."""
    sass = _disassemble(compile_config(config, **kw))[1]
    return [m[1] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)",
                                      sass)]  # fmt: skip


def loop_report(
    config: str, *, bits: int = 8, arch: int = 90, rows: int = tuning.SINGLE_TILE
) -> dict:
    """Registers, spill bytes, shared memory, and the opcodes of the tensor-core loop."""
    return _report(compile_config(config, bits=bits, arch=arch, rows=rows), config)


ATTENTION_CACHES = ("fp16", "bf16", "int8", "int8-biased")


def attention_report(cache: str, *, arch: int = 90) -> dict:
    """loop_report's figures for the decode attention over an fp16, bf16 or int8 cache (an int8
    cache beside fp16 activations by the exact route, MPINFER_KV8_BIASED=0; int8-biased: by the
    biased route, the default)."""
    q8 = cache.startswith("int8")
    compiled = compile_attention(q8, "fp16" if q8 else cache, arch=arch, biased=cache != "int8")
    return _report(compiled, f"decode attention, {cache} cache")


def compile_attention(quant: bool, dtype: str = "fp16", *, arch: int = 90, block_l: int = 32,
                      warps: int = 2, biased: bool = False):  # fmt: skip
    """The decode attention's first kernel (kernels/attention.py) for BLOOM's head_dim 128 over
    16-token blocks: an fp16/bf16 cache (`dtype`) or an int8 one (`quant`)."""
    from ...model.kernels import attention

    kernel = attention._decode_attention_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    fixed = dict(HEAD_DIM=128, BLOCK_L=block_l, BLOCK_SIZE=16, QUANT=quant, BIASED=biased,
                 ROWS=min(4 * warps, block_l))  # fmt: skip
    cache = "*i8" if quant else f"*{dtype}"
    types = dict(qkv_ptr=f"*{dtype}", k_ptr=cache, v_ptr=cache, ks_ptr="*fp32", vs_ptr="*fp32",
                 ws_ptr="*fp32", slope_ptr="*fp32", scale="fp32")  # fmt: skip
    sig = {n: "constexpr" if n in fixed else types.get(n, "*i64" if n.endswith("_ptr") else "i32")
           for n in names}  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n.startswith("stride")}  # fmt: skip
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in fixed.items()},
                    attrs=attrs)  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=attention.STAGES))  # fmt: skip


def _report(compiled, config: str) -> dict:
    """Registers, spill bytes, shared memory, and the opcodes of the compiled kernel's loop."""
    usage, sass = _disassemble(compiled)
    found = [(int(m[1], 16), m[2], line) for line in sass.splitlines()
             if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(\S+(?: \S+)?)", line))]  # fmt: skip
    loops = [[op for a, op, _ in found if int(m[1], 16) <= a <= addr] for addr, _, line in found
             if (m := re.search(r"BRA (0x[0-9a-f]+)", line)) and int(m[1], 16) < addr]  # fmt: skip
    # the main loop: the one with the tensor-core ops, else (the one-row loop) the longest
    mma = [b for b in loops if any(op.startswith(("HGMMA", "HMMA")) for op in b)]
    loop = (mma or sorted(loops, key=len, reverse=True) or [[]])[0]
    ops = Counter(re.sub(r"^@!?U?P\w+ ", "", op).split()[0].split(".")[0] for op in loop)
    return {"config": config, "arch": compiled.metadata.arch, "triton": triton.__version__,
            "registers": int(re.search(r"REG:(\d+)", usage)[1]),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage)[1]),
            "shared_bytes": compiled.metadata.shared, "loop_instructions": len(loop),
            # setmaxnreg: the partitions of a warp-specialized kernel re-balance their registers
            "warp_specialized": "USETMAXREG" in sass,
            "loop_ops": dict(ops.most_common())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help='config names, e.g. "swap n128 k64 split1 ..."')
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    ap.add_argument(
        "--rows",
        type=int,
        default=tuning.SINGLE_TILE,
        help="the launch's rows: a config without BLOCK_M tiles its bucket's",
    )
    ap.add_argument("--attention", action="store_true",
                    help="the decode attention's (CONFIGS: its caches)")  # fmt: skip
    a = ap.parse_args()
    for config in a.configs:
        if a.attention:
            if config not in ATTENTION_CACHES:
                ap.error(f"--attention: {config!r} is not one of {', '.join(ATTENTION_CACHES)}")
            r = attention_report(config, arch=a.arch)
        else:
            r = loop_report(config, bits=a.bits, arch=a.arch, rows=a.rows)
        top = ", ".join(f"{k} {v}" for k, v in list(r["loop_ops"].items())[:12])
        print(f"{r['config']} ({r['arch']}, Triton {r['triton']}): {r['registers']} registers, "
              f"{r['stack_bytes']} B of stack (spills), {r['shared_bytes']} B shared"
              f"{', warp-specialized' if r['warp_specialized'] else ''}; loop "
              f"{r['loop_instructions']} instructions: {top}")  # fmt: skip


if __name__ == "__main__":
    main()
