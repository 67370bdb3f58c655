"""Run under TRITON_INTERPRET=1 by tests/test_kernels.py: the GPU kernels (W8A16, W4A16, the
dequantizers, a mixed step's attention over an fp32 and an int8 KV cache) executed by Triton's
interpreter on CPU tensors, against the pure-torch reference on fresh random inputs. Prints one
line per case and exits 1 if any case is off.

    TRITON_INTERPRET=1 python tests/kernel_interp_worker.py
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from mpinfer.model.kernels import (  # noqa: E402
    attention,
    dequant,
    tuning,
    w4a16,
    w8a16,
    w8a16_tma,
)
from mpinfer.model.quant import dequantize_int4, quantize_int4, quantize_rows  # noqa: E402

# The interpreter has no CUDA device: one CPU scratch for both kernels.
SCRATCH = (torch.zeros(tuning.WORKSPACE_BYTES // 4),
           torch.zeros(tuning.COUNTERS, dtype=torch.int32))  # fmt: skip
for module in (w8a16, w4a16, w8a16_tma):
    module.device_scratch = lambda device: SCRATCH
attention.sm_count = lambda index: 4  # the decode attention sizes its splits by the GPU's SMs


def fused(y, gelu, res):
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y + res.float() if res is not None else y


def check(label, y, ref, tol: float = 1e-2) -> bool:
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    # fp16 outputs and weights: 2^-11 relative each; 1e-2 of the largest value is far above
    # that and far below a wrong tile, split or nibble (errors of order 1).
    ok = err < tol and not SCRATCH[1].any()
    print(f"{label}: max error {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    dt = torch.float16
    ok = True
    N, K = 100, 640  # ragged against every tile: N % 16, K % 256
    q, s = quantize_rows(torch.randn(N, K, generator=g))
    b = torch.randn(N, generator=g).to(dt)
    for M, cfg in [(1, "fma n16 k256 split1 pf0 magic0 w4 s3"),
                   (1, "fma n8 k512 split1 pf1 magic1 w4 s1"),
                   (1, "dot n64 k128 split3 pf0 magic0 w4 s3"),
                   (5, "dot n32 k128 split2 pf0 magic1 w4 s3"),
                   (20, "swap n64 k128 split1 pf0 magic0 w4 s4"),
                   (130, "dot n64 k64 split1 pf0 magic1 w4 s3 m64"),
                   (130, "swap n64 k64 split2 pf0 magic0 w4 s3 m64"),
                   (130, "swap n64 k64 split1 pf0 magic6 w4 s3 m64"),
                   (130, "tma n128 k128 split1 pf0 magic6 w4 s3 m128"),  # K % 128: zero-filled
                   (200, "tma n64 k64 split1 pf0 magic0 w4 s4 m64"),
                   (130, "tma n128 k128 split4 pf0 magic6 w4 s3 m128"),  # an empty last split
                   (200, "tma n64 k64 split3 pf0 magic0 w4 s4 m64"),
                   (20, "tma n128 k64 split1 pf0 magic6 w4 s4"),  # one tile of the bucket's 32
                   (50, "tma n128 k128 split2 pf0 magic1 w4 s3")]:  # fmt: skip
        x = torch.randn(M, K, generator=g).to(dt)
        res = torch.randn(M, N, generator=g).to(dt)
        y = w8a16.w8a16_matmul(x, q, s, b, gelu=True, residual=res, config=cfg)
        ok &= check(f"int8 {M} rows {cfg}", y, fused(x.float() @ q.float().T * s + b.float(),
                                                     True, res))  # fmt: skip
    # a tma config on a Triton that cannot build it runs its tile in the swap loop, once warned
    real = w8a16.w8a16_tma_matmul

    def unbuildable(*args):
        raise RuntimeError("PassManager::run failed (a stand-in)")

    w8a16.w8a16_tma_matmul = unbuildable
    try:
        x = torch.randn(130, K, generator=g).to(dt)
        for _ in range(2):  # the second launch goes straight to the swap loop
            y = w8a16.w8a16_matmul(x, q, s, b, config="tma n128 k64 split1 pf0 magic6 w4 s3 m128")
            ok &= check("int8 tma unbuilt -> swap", y, x.float() @ q.float().T * s + b.float())
        ok &= len(w8a16_tma.TMA_UNBUILT) == 1
    finally:
        w8a16.w8a16_tma_matmul = real
        w8a16_tma.TMA_UNBUILT.clear()
    N, K = 100, 640  # five groups of 128: uneven splits, a last odd group for two-at-a-time
    for sym in (False, True):
        p, s4, o4 = quantize_int4(torch.randn(N, K, generator=g), 128, symmetric=sym)
        w = dequantize_int4(p, s4, o4)
        for M, cfg in [(1, "fma n16 k128 split1 pf0 magic0 w4 s3"),
                       (1, "fma n32 k128 split3 pf0 magic0 w4 s3"),
                       (1, "fma n16 k128 split2 pf1 magic0 w4 s3"),
                       (1, "fma n32 k128 split3 pf0 magic3 w4 s3"),
                       (1, "fma n16 k128 split2 pf1 magic3 w4 s3"),
                       (1, "fma n32 k128 split3 pf0 magic5 w4 s3"),
                       (1, "fma n16 k128 split2 pf1 magic5 w4 s3 r80"),
                       (1, "fma n32 k128 split3 pf0 magic8 w4 s3"),
                       (1, "fma n64 k128 split2 pf1 magic8 w4 s3"),
                       (1, "fma n32 k128 split3 pf1 magic9 w4 s3"),
                       (1, "fma n32 k128 split3 pf0 magic8 w4 s1"),  # s1: not carried
                       (1, "fma n64 k128 split2 pf1 magic8 w4 s1"),
                       (1, "fma n32 k128 split3 pf1 magic9 w4 s1"),
                       (1, "fma n32 k128 split4 pf1 magic8 w4 s3"),  # an empty last split
                       (5, "dot n32 k128 split2 pf0 magic1 w4 s3"),
                       (20, "swap n64 k128 split1 pf0 magic0 w4 s4"),
                       (130, "dot n64 k128 split1 pf0 magic1 w4 s3 m64"),
                       (130, "swap n64 k128 split2 pf0 magic0 w4 s3 m64"),
                       (1, "swap n64 k128 split3 pf0 magic7 w4 s4"),
                       (20, "swap n64 k128 split2 pf0 magic7 w4 s4"),
                       (130, "swap n64 k128 split1 pf0 magic7 w4 s3 m64")]:  # fmt: skip
            x = torch.randn(M, K, generator=g).to(dt)
            res = torch.randn(M, N, generator=g).to(dt)
            y = w4a16.w4a16_matmul(x, p, s4, o4, b, gelu=True, residual=res, config=cfg)
            ok &= check(f"int4 sym={sym} {M} rows {cfg}", y,
                        fused(x.float() @ w.T + b.float(), True, res))  # fmt: skip
            if "magic8" in cfg or "magic9" in cfg:  # the packed loop by half lines too
                y = w4a16.w4a16_matmul(x, p, s4, o4, b, gelu=True, residual=res, config=cfg,
                                       lines=False)  # fmt: skip
                ok &= check(f"int4 sym={sym} {M} rows {cfg} half lines", y,
                            fused(x.float() @ w.T + b.float(), True, res))  # fmt: skip
    # magic7, magic8 and magic9 where a group's offset is far past its range (z * sum(x) dwarfs
    # s * sum(q x): a dropped or misplaced offset term shows) and where a group is constant
    w = torch.randn(N, K, generator=g)
    w[::7, 128:256] = 40 + 1e-3 * torch.randn(w[::7, 128:256].shape, generator=g)
    w[3, :128] = -2.5
    p, s4, o4 = quantize_int4(w, 128)
    w = dequantize_int4(p, s4, o4)
    for M, cfg in [(1, "swap n64 k128 split1 pf0 magic7 w4 s4"),
                   (130, "swap n64 k128 split2 pf0 magic7 w4 s3 m64"),
                   (1, "fma n32 k128 split2 pf1 magic8 w4 s3"),
                   (1, "fma n32 k128 split2 pf1 magic8 w4 s1"),
                   (1, "fma n32 k128 split2 pf0 magic9 w4 s3")]:  # fmt: skip
        x = torch.randn(M, K, generator=g).to(dt)
        for lines in (True, False) if "magic8" in cfg or "magic9" in cfg else (True,):
            y = w4a16.w4a16_matmul(x, p, s4, o4, None, config=cfg, lines=lines)
            ref = x.float() @ w.T
            ok &= check(f"int4 offset-heavy groups {M} rows {cfg}{' half lines' * (not lines)}",
                        y, ref)  # fmt: skip
            tight = ((y.float() - ref).abs() / (x.float().abs() @ w.abs().T)).max().item()
            print(f"  error / sum |x w|: {tight:.1e} {'ok' if tight < 2e-3 else 'FAIL'}",
                  flush=True)  # fmt: skip
            ok &= tight < 2e-3
    for G in (64, 128):
        p, s4, o4 = quantize_int4(torch.randn(37, 512, generator=g), G)
        ok &= check(
            f"dequantize int4 groups of {G}",
            dequant.dequantize_int4(p, s4, o4, torch.float32),
            dequantize_int4(p, s4, o4),
        )
    q, s = quantize_rows(torch.randn(37, 700, generator=g))
    ok &= check("dequantize int8", dequant.dequantize(q, s, torch.float32), q.float() * s[:, None])
    for kv in ("model", "int8"):
        ok &= attention_case(kv, g)
    return 0 if ok else 1


def attention_case(kv: str, g: torch.Generator) -> bool:
    """A mixed step's three attention launches (store_kv, decode rows, prompt-chunk tiles) on an
    fp32 model over shuffled blocks of 16, against the pure-torch reference on a copy of the
    same cache: decode rows of 70 and 7 keys, a chunk that starts mid-row, one of one token."""
    from mpinfer.engine.runner import Layout, StepInputs
    from mpinfer.engine.step import Prefill, Step
    from mpinfer.model.attention import FlatBatch, KVCache, attend_kernels, attend_reference
    from mpinfer.model.bloom import BloomShape, alibi_slopes

    heads, hd, q8 = 2, 128, kv == "int8"
    shape = BloomShape(vocab_size=100, hidden_size=heads * hd, n_layer=1, n_head=heads)
    caches = [KVCache.allocate(shape, 1, slots=4, max_seq=96, dtype=torch.float32,
                               device="cpu", block_size=16, quantized=q8)
              for _ in range(2)]  # fmt: skip
    perm = torch.randperm(caches[0].tables.numel(), generator=g)
    for c in caches:
        c.tables = perm.view_as(c.tables)
    for a, b in zip(caches[1].k + caches[1].v, caches[0].k + caches[0].v):
        b.copy_(torch.randint(-127, 128, b.shape, generator=g) if q8 else torch.randn(b.shape,
                generator=g))  # fmt: skip
        a.copy_(b)
    if q8:  # scales of keys and values with magnitudes around 1
        for a, b in zip(caches[1].k_scale + caches[1].v_scale,
                        caches[0].k_scale + caches[0].v_scale):  # fmt: skip
            a.copy_(b.uniform_(0.5 / 127, 2 / 127, generator=g))
    step = Step(decode_slots=(3, 1), decode_pos=(70, 7),
                prefills=(Prefill(0, 20, tuple(range(40))), Prefill(2, 5, (9,))))  # fmt: skip
    lay = Layout.of(step)
    n = len(lay.ids)
    inputs = StepInputs.allocate(64, 4, "cpu")
    inputs.buf.copy_(torch.tensor(inputs.host(lay, step, pad=3)))
    ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles = inputs.views()
    qkv = torch.randn(64, heads * 3 * hd, generator=g)
    slopes = alibi_slopes(heads)
    batch = FlatBatch(seq, pos, dec_seq, dec_pos, tiles)
    out_k = attend_kernels(qkv, caches[0].layer(0), caches[0].tables, batch, slopes, heads, hd)
    ref_batch = FlatBatch(seq[:n], pos[:n], dec_seq[:2], dec_pos[:2], tiles, lay.segments(step))
    out_r = attend_reference(qkv[:n], caches[1].layer(0), caches[1].tables, ref_batch, slopes,
                             heads, hd)  # fmt: skip
    ok = check(f"attention over a {kv} cache", out_k[:n], out_r)
    # the merge of 35 splits (the policy's most is 32), most of them empty, gives what one
    # split does (an int8 cache: by the exact route, MPINFER_KV8_BIASED=0)
    k_c, v_c, sc = caches[0].layer(0)
    one, many = (attention.decode_attention(qkv[: batch.decode_rows], k_c, v_c, dec_seq, dec_pos,
                                            batch.dec_from, slopes, caches[0].tables, scales=sc,
                                            n_splits=n, biased=False) for n in (1, 35))  # fmt: skip
    ok &= check(f"decode attention over a {kv} cache, 35 splits against one", many, one.float())
    if q8:  # the biased route (the default), at the policy's splits and at 35, in tiles
        # of 32 and 64 keys (MPINFER_KV8_TILE_KEYS), its partial rows 4 a warp
        for n, tile, warps in ((None, 32, 2), (35, 32, 2), (None, 64, 2), (35, 64, 4)):
            biased = attention.decode_attention(qkv[: batch.decode_rows], k_c, v_c, dec_seq,
                                                dec_pos, batch.dec_from, slopes, caches[0].tables,
                                                scales=sc, n_splits=n, biased=True,
                                                block_l=tile, num_warps=warps)  # fmt: skip
            # fp32 here: its error is the constant's removal (1.5e-5 to 5.7e-5); a constant one
            # off gives 1.2e-2, the new token left out of the partials 0.5
            ok &= check(f"decode attention over an int8 cache, biased, splits {n or 'policy'}, "
                        f"{tile} keys a tile, {warps} warps", biased, one.float(),
                        tol=1e-3)  # fmt: skip
    # padding tokens' rows are store_kv's to zero (the output is not cleared first): zeros
    # there, every other row left as it was
    rows = torch.full((64, heads * hd), float("nan"))
    attention.store_kv(qkv, *caches[0].layer(0)[:2], seq, pos, caches[0].tables,
                       caches[0].layer(0)[2], rows)  # fmt: skip
    pad = seq < 0
    zeroed = bool(pad.any() and rows[pad].eq(0).all() and rows[~pad].isnan().all())
    print(f"  padding tokens' rows zeroed by store_kv, the others untouched: "
          f"{'ok' if zeroed else 'FAIL'}")  # fmt: skip
    ok &= zeroed and bool(out_k[pad].eq(0).all())
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):  # what was written
        same = (a.float() - b.float()).abs().max().item() <= (1 if q8 else 1e-6)
        ok &= same
        print(f"  cache written as the reference writes it: {'ok' if same else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
