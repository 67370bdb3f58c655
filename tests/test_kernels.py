"""The GPU kernels on the CPU: Triton's interpreter (TRITON_INTERPRET=1) runs the W8A16 and W4A16
matmuls (every loop, uneven splits, tiles of rows past 64, the fused epilogue) and the
dequantizers on CPU tensors, against the pure-torch reference on fresh random inputs
(tests/kernel_interp_worker.py). CI installs Triton beside the CPU build of torch for this (the
Makefile); on a GPU the same kernels are compiled and tests/test_gpu.py checks them."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ENV, ROOT


def test_the_matmul_kernels_match_the_reference_under_the_interpreter():
    proc = subprocess.run([sys.executable, "tests/kernel_interp_worker.py"], cwd=ROOT,
                          env={**ENV, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") >= 20, proc.stdout


def test_the_swap_loop_compiles_for_hopper_with_the_pair_conversion_cheaper():
    """Compiled for sm_90a here (Triton's own ptxas; no GPU): the 128-row swap tile's main loop
    runs the tensor cores' wgmma with no local-memory traffic, and converting the fragment's
    int8 pairs as loaded (magic6) leaves it fewer byte permutes and instructions than packing
    them four at a time (magic2), which is why the H100's sweep chose it (docs/performance.md,
    round 8)."""
    from mpinfer.tools.diag.kernel_sass import loop_report

    two, six = (loop_report(f"swap n128 k64 split1 pf0 magic{m} w8 s3 m128") for m in (2, 6))
    for r in (two, six):
        assert r["loop_ops"].get("HGMMA", 0) >= 4, r
        assert not r["loop_ops"].get("LDL") and not r["loop_ops"].get("STL"), r
        assert r["loop_ops"].get("LDGSTS", 0) > 0, r  # pipelined: asynchronous copies ahead
    assert six["loop_ops"]["PRMT"] * 2 < two["loop_ops"]["PRMT"], (two, six)
    assert six["loop_instructions"] < two["loop_instructions"], (two, six)


def test_a_register_capped_config_compiles_to_its_cap_with_no_spills_in_the_loop():
    """A config's "r80" reaches the compiler (Triton's maxnreg): the one-row int4 loop of two
    groups an iteration, capped, uses at most 80 registers a thread (six programs of 4 warps in
    an SM's 65,536 instead of five); uncapped, the same config takes more. Whether the cap
    spills depends on the Triton version (the GPU machine's 3.6: nothing; CI's 3.9 spills in
    the loop), which is for the tuner to weigh on the GPU, not for this test."""
    from mpinfer.tools.diag.kernel_sass import loop_report

    free, capped = (loop_report(f"fma n64 k128 split8 pf1 magic5 w4 s3{tail}", bits=4, rows=1)
                    for tail in ("", " r80"))  # fmt: skip
    assert capped["registers"] <= 80 < free["registers"], (free, capped)


def test_the_packed_fp16_one_row_int4_loop_compiles_to_fewer_instructions_than_magic5():
    """magic8 does a pair of products in one fma.f16x2 on q - 8 made exact in two fp16 lanes:
    compiled for sm_90a, the one-row loop of the same tile (64 rows, two groups an iteration,
    128 weights a thread) has its products in HFMA2 (at least one a pair), next to no fp32 work,
    no local memory, and at most two-thirds of magic5's instructions (Triton 3.6: 410 against
    560; 3.9: 391 against 648). With num_stages 3 it carries the next tile's weights across
    iterations: more registers (Triton 3.6: 95 against 56; 3.9: 96 against 80), about the same
    instructions."""
    from mpinfer.tools.diag.kernel_sass import loop_report

    five, eight, carried = (loop_report(f"fma n64 k128 split8 pf1 magic{m} w4 s{s}", bits=4,
                                        rows=1) for m, s in ((5, 3), (8, 1), (8, 3)))  # fmt: skip
    for r in (eight, carried):
        ops = r["loop_ops"]
        assert ops.get("HFMA2", 0) >= 64 and ops.get("FFMA", 0) <= 16, r
        assert not ops.get("LDL") and not ops.get("STL") and not r["stack_bytes"], r
        assert 3 * r["loop_instructions"] <= 2 * five["loop_instructions"], (five, r)
    assert carried["registers"] >= eight["registers"] + 12, (eight, carried)  # 16 words a thread
    assert carried["loop_instructions"] <= 1.1 * eight["loop_instructions"], (eight, carried)


def test_the_tma_loop_compiles_warp_specialized_for_hopper():
    """The `tma` loop (w8a16_tma.py) compiled for sm_90a: Triton splits it into a producer of
    copies and consumer warp groups that re-balance their registers (setmaxnreg), with no
    spills, the tensor-core ops in the consumers' loop, and fewer instructions there than the
    pointer-loaded swap loop of the same tile spends (Triton 3.9: 135 against 197; 3.6: 133
    against 197). The same kernel with its weight's descriptor made by the launcher was not
    partitioned consistently (round 13), so a regression there shows as no warp specialization
    or a failed compile. A split config stores its partial sums for a second launch to add (the
    split-K counters' epilogue stopped the partitioning, round 13), and stays warp-specialized.
    So does one tile of a few-row bucket's rows (round 15: 32 rows, 114 instructions)."""
    from mpinfer.tools.diag.kernel_sass import loop_report

    swap = loop_report("swap n128 k64 split1 pf0 magic6 w8 s3 m128")
    for cfg, rows in (
        ("tma n128 k64 split1 pf0 magic6 w4 s3 m128", 256),
        ("tma n128 k64 split1 pf0 magic6 w4 s3 m256", 256),
        ("tma n128 k64 split3 pf0 magic6 w4 s3 m128", 256),  # partial sums stored, no counters
        ("tma n128 k64 split1 pf0 magic6 w4 s4", 32),
    ):
        tma = loop_report(cfg, rows=rows)
        assert tma["warp_specialized"] and not swap["warp_specialized"], (tma, swap)
        assert not tma["stack_bytes"] and tma["loop_ops"].get("HGMMA", 0) >= 4, tma
        assert tma["loop_instructions"] < 0.8 * swap["loop_instructions"], (tma, swap)


def test_the_int8_cache_attention_converts_without_the_conversion_unit():
    """The decode attention over an int8 cache, compiled for sm_90a: its loop turns bytes into
    fp32 with byte permutes (w8a16's packed conversion, one PRMT a value), not the conversion
    unit's I2F, which Hopper runs at 16 values a clock per SM and which bound the loop before
    round 9; no spills; about the fp16 cache's instructions a tile (Triton 3.9: 908 against 860;
    3.6: 911 against 864), half its bytes."""
    from mpinfer.tools.diag.kernel_sass import attention_report

    fp16, int8 = (attention_report(cache) for cache in ("fp16", "int8"))
    ops = int8["loop_ops"]
    # (a few I2F remain: the ALiBi bias's key positions; the bytes through I2F were 128 a tile)
    assert ops.get("I2F", 0) <= 8 and ops.get("PRMT", 0) >= 128, int8
    assert not ops.get("LDL") and not ops.get("STL") and not int8["stack_bytes"], int8
    assert int8["loop_instructions"] <= 1.2 * fp16["loop_instructions"], (fp16, int8)


def test_the_biased_int8_route_compiles_to_fewer_instructions():
    """The int8 cache's biased route (the default; MPINFER_KV8_BIASED=0 the exact loop) drops
    the subtract of each converted byte and sums the values across keys after the loop: compiled
    for sm_90a its loop has at most 80 % of the exact loop's instructions a tile (Triton 3.9: 692
    against 908; the subtract alone made it 814), far fewer shuffles, no more registers, still
    no bytes through I2F and no spills."""
    from mpinfer.tools.diag.kernel_sass import attention_report

    exact, biased = (attention_report(cache) for cache in ("int8", "int8-biased"))
    assert biased["loop_instructions"] <= 0.8 * exact["loop_instructions"], (exact, biased)
    assert biased["loop_ops"]["SHFL"] <= exact["loop_ops"]["SHFL"] / 2, (exact, biased)
    assert biased["registers"] <= exact["registers"], (exact, biased)
    ops = biased["loop_ops"]
    assert ops.get("I2F", 0) <= 8 and not ops.get("LDL") and not biased["stack_bytes"], biased
