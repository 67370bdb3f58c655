"""GPU tests of the kernels (run on the GPU machine: pytest -m gpu): the Triton matmuls, decode
attention and LayerNorm against the pure-torch reference on fresh random inputs, odd shapes
included, every config family a table may pick. The engine and the server on a GPU are
tests/test_gpu_engine.py's."""

from __future__ import annotations

import os

import pytest
import torch

from mpinfer.model.quant import int8_linear_reference, quantize_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


ROWS = [1, 3, 16, 17, 64, 100, 128, 256, 576, 2048]  # every row bucket, ragged ones too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N, K", [(4096, 4096), (1000, 1000), (513, 777), (5376, 14336)])
def test_int8_linear_matches_reference(M, N, K, dtype):
    from mpinfer.model.kernels import int8_linear

    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    q, scale = quantize_rows(torch.randn(N, K, device="cuda", generator=g))
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = torch.randn(N, device="cuda", generator=g, dtype=dtype)
    ours = int8_linear(x, q, scale, bias).float()
    ref = int8_linear_reference(x.float(), q, scale, bias.float())
    # fp32 accumulation in both; the output rounding of a 16-bit float is 2^-8 (bf16) or 2^-11
    # (fp16) relative, and values are ~sqrt(K): a relative 1e-2 bound with an absolute floor.
    torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def _int4_reference(x, packed, scale, offset, bias, gelu=False, residual=None):
    from mpinfer.model.quant import dequantize_int4

    y = x.float() @ dequantize_int4(packed, scale, offset).T + bias.float()
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y + residual.float() if residual is not None else y


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N, K, group", [(4096, 4096, 128), (1000, 1024, 64), (513, 1792, 128),
                                         (5376, 14336, 128), (300, 2048, 256)])  # fmt: skip
def test_int4_linear_matches_dequantized_reference(M, N, K, group, dtype):
    """The W4A16 kernel against the same packed weight dequantized in fp32: the weight's
    conversion (fp16 arithmetic for fp16, fp32 for bf16) and the output's rounding are the only
    differences."""
    from mpinfer.model.kernels import int4_linear
    from mpinfer.model.quant import quantize_int4

    g = torch.Generator(device="cuda").manual_seed(M * 5 + N + K)
    w = torch.randn(N, K, device="cuda", generator=g)
    packed, scale, offset = quantize_int4(w, group, symmetric=M % 2 == 1)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = torch.randn(N, device="cuda", generator=g, dtype=dtype)
    ours = int4_linear(x, packed, scale, offset, bias).float()
    ref = _int4_reference(x, packed, scale, offset, bias)
    # fp16 weights w = q s + z round at 2^-11 relative before the fp32-accumulated dot: the
    # same bound as the int8 kernel's.
    torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def _fused_reference(x, q, scale, bias, gelu, residual):
    y = int8_linear_reference(x.float(), q, scale, bias.float())
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y + residual.float() if residual is not None else y


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (5, 1000, 4160), (32, 16384, 4096),
                                     (300, 4096, 4096), (576, 12288, 4096)])  # fmt: skip
@pytest.mark.parametrize("epilogue", ["gelu", "residual"])
def test_int8_and_int4_fused_epilogues_are_exact_and_repeatable(M, N, K, dtype, epilogue):
    """Both kernels with the GeLU or the residual add in their epilogue, against the
    reference, and bit-identical across calls (split-K partials are summed in a fixed order)."""
    from mpinfer.model.kernels import int4_linear, int8_linear
    from mpinfer.model.quant import quantize_int4

    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    w = torch.randn(N, K, device="cuda", generator=g)
    q, scale = quantize_rows(w)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
    bias = torch.randn(N, device="cuda", generator=g, dtype=dtype)
    res = torch.randn(M, N, device="cuda", generator=g, dtype=dtype) * 10
    res = res if epilogue == "residual" else None
    gelu = epilogue == "gelu"
    ours = [int8_linear(x, q, scale, bias, gelu=gelu, residual=res) for _ in range(3)]
    ref = _fused_reference(x, q, scale, bias, gelu, res)
    torch.testing.assert_close(ours[0].float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(ours[0], ours[1]) and torch.equal(ours[0], ours[2])
    if K % 128 == 0:
        p4 = quantize_int4(w, 128)
        ours4 = [int4_linear(x, *p4, bias, gelu=gelu, residual=res) for _ in range(3)]
        ref4 = _int4_reference(x, *p4, bias, gelu, res)
        torch.testing.assert_close(ours4[0].float(), ref4, rtol=1e-2,
                                   atol=1e-2 * ref4.abs().max().item())  # fmt: skip
        assert torch.equal(ours4[0], ours4[1]) and torch.equal(ours4[0], ours4[2])


def test_one_row_tuning_is_never_reused_for_several_rows():
    """One row may tune to the one-row loop, which computes row 0 only; 2..16 rows of the same
    shape must get their own config, not that one (they did once: rows 1.. came out empty)."""
    from mpinfer.model.kernels import int8_linear

    g = torch.Generator(device="cuda").manual_seed(11)
    N, K = 4096, 4096  # a shape whose one-row winner on the H200 is the one-row loop
    q, scale = quantize_rows(torch.randn(N, K, device="cuda", generator=g))
    bias = torch.randn(N, device="cuda", generator=g, dtype=torch.float16)
    for M in (1, 5, 16, 1):
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.float16)
        ref = int8_linear_reference(x.float(), q, scale, bias.float())
        ours = int8_linear(x, q, scale, bias).float()
        torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_config_family_split_k(bits, dtype):
    """Every kernel variant a table or the default rule may pick, with 1 and with 3 K-splits
    (an uneven split, one of them shorter), on a shape with a ragged edge in N (and in K for
    int8), at 1, 7 and 20 rows, the tiled families at 150 rows (three row tiles of 64, two of
    128), the few-row `tma` ones at 20 and 50: it matches the reference and leaves every tile
    counter at zero for the next launch. Tuning only ever runs the winner, so without this a
    broken variant could wait for the one GPU it wins on. MPINFER_FAMILY_ONLY=magic8,magic9
    (words of the names; "tma+magic6": both words) runs those configs alone, for a GPU call
    that checks a new family and has no time for the others (select the dtype and bits that
    have them with -k: a filter that matches nothing fails)."""
    from mpinfer.model.kernels import launch, tuning, w4a16, w8a16, w8a16_tma
    from mpinfer.model.quant import quantize_int4

    _, counters = launch.device_scratch(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(3)
    N, K = 1000, 2112 if bits == 8 else 2048
    w = torch.randn(N, K, device="cuda", generator=g)
    bias = torch.randn(N, device="cuda", generator=g, dtype=dtype)
    dt = tuning.dtype_name(dtype)
    if bits == 8:
        q, scale = quantize_rows(w)
        names = (tuning.names(tuning.SWEEP_FAMILIES, (1, 3), dt)
                 + tuning.names(tuning.FEW_ROW_TMA, (1, 3), dt)
                 + tuning.names(tuning.TILED_FAMILIES, (1, 3), dt))  # fmt: skip
    else:
        p4 = quantize_int4(w, 128)
        names = tuning.names(tuning.INT4_FAMILIES, (1, 3), dt, bits=4, group=128)
    only = os.environ.get("MPINFER_FAMILY_ONLY")
    names = [n for n in names if only is None  # any alternative, all of whose words are in n
             or any(set(alt.split("+")) <= set(n.split()) for alt in only.split(","))]  # fmt: skip
    assert names, f"MPINFER_FAMILY_ONLY={only}: no {dt} int{bits} config has it (pick its -k)"
    failures = []
    for config in names:
        kw, _, _ = tuning.parse(config)
        rows = (150,) if kw["BLOCK_M"] else (20, 50) if kw["TMA"] else (1, 7, 20) if \
            kw["USE_DOT"] else (1,)  # fmt: skip
        for M in rows:
            if tuning.illegal(config, M, N, K, dt, bits=bits, group=128 if bits == 4 else 0):
                continue  # what `illegal` refuses: one row in swap (but int4's magic7), int4
                # magic2 in swap, or with bf16 in a dot
            x = torch.randn(M, K, device="cuda", generator=g, dtype=dtype)
            res = torch.randn(M, N, device="cuda", generator=g, dtype=dtype)
            if bits == 8:
                y = w8a16.w8a16_matmul(x, q, scale, bias, gelu=True, residual=res, config=config)
                ref = _fused_reference(x, q, scale, bias, True, res)
            else:
                y = w4a16.w4a16_matmul(x, *p4, bias, gelu=True, residual=res, config=config)
                ref = _int4_reference(x, *p4, bias, True, res)
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            if not err < 1e-2 or counters.any():
                failures.append((config, M, err))
            counters.zero_()
    assert not failures, failures
    # a tma config that fell back to the swap loop passed as another kernel: name it
    assert not w8a16_tma.TMA_UNBUILT, w8a16_tma.TMA_UNBUILT


@pytest.mark.parametrize("splits", [None, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_decode_attention_matches_eager_model(dtype, splits, monkeypatch):
    """The fused decode attention against the eager model, with the splits its policy picks
    here (8: one per 32-key tile of the cache) and forced ones: a row's whole history in one
    program (up to 6 tiles, the last ragged) or in two uneven ones, so a large batch's long
    programs are checked on a small batch."""
    from mpinfer.model.bloom import BloomModel, BloomShape, KVCache
    from mpinfer.model.kernels import attention
    from mpinfer.model.layers import TPGroup
    from mpinfer.model.quant import Int8Method
    from mpinfer.tools.randmodel import randomize_model

    shape = BloomShape(vocab_size=3000, hidden_size=384, n_layer=2, n_head=6)
    model = BloomModel(shape, TPGroup(0, 1), method=Int8Method(), dtype=dtype)
    model = model.to_empty(device="cuda")
    randomize_model(model, seed=1)
    if splits is not None:
        monkeypatch.setattr(attention, "attention_splits", lambda *_: splits)
    B = 3
    slots = torch.tensor([2, 0, 5], device="cuda")
    lens = [37, 5, 200]
    caches = [KVCache.allocate(shape, 1, slots=6, max_seq=256, dtype=dtype, device="cuda")
              for _ in range(2)]  # fmt: skip
    for b, n in enumerate(lens):  # prefill each row's history (eager path, T > 1)
        ids = torch.randint(4, 3000, (1, n), device="cuda")
        z = torch.zeros(1, dtype=torch.long, device="cuda")
        for c in caches:
            model(ids, c, slots=slots[b : b + 1], start_pos=z, valid_from=z, kv_len=n)
    valid_from = torch.tensor([4, 0, 10], device="cuda")  # rows 0 and 2 are left-padded
    token = torch.randint(4, 3000, (B, 1), device="cuda")
    pos = torch.tensor(lens, device="cuda")
    qkv0 = []  # layer 0's QKV output in the fused step
    hook = model.h[0].self_attention.query_key_value.register_forward_hook(
        lambda mod, args, out: qkv0.append(out.clone())
    )
    outs = []
    for use_kernels, c in zip((True, False), caches):
        model.use_kernels = use_kernels
        outs.append(model(token, c, slots=slots, start_pos=pos, valid_from=valid_from,
                          kv_len=max(lens) + 1).float())  # fmt: skip
    hook.remove()
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=5e-2)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).all()
    # The fused kernel writes this step's K and V exactly as the QKV matmul made them, at each
    # row's slot and position (laid out [heads, 3, head_dim]).
    k_new, v_new = qkv0[0][:, 0].view(B, shape.n_head, 3, shape.head_dim)[:, :, 1:].unbind(2)
    for b in range(B):
        assert torch.equal(caches[0].k[0][slots[b], :, pos[b]], k_new[b]), b
        assert torch.equal(caches[0].v[0][slots[b], :, pos[b]], v_new[b]), b
    # The two paths' caches agree up to rounding: the fused path's LayerNorm is a Triton kernel
    # (not bit-equal to torch's), and deeper layers see the previous layer's attention output.
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("hidden", [64, 1000, 4096, 14336])
def test_layer_norm_kernel_matches_torch(hidden):
    from mpinfer.model.kernels.layernorm import layer_norm_rows

    ln = torch.nn.LayerNorm(hidden, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(3, 1, hidden, device="cuda", dtype=torch.float16) * 3 + 1
    ref = torch.nn.functional.layer_norm(x.float(), (hidden,), ln.weight.float(), ln.bias.float())
    torch.testing.assert_close(layer_norm_rows(x, ln.weight, ln.bias, ln.eps).float(), ref,
                               rtol=1e-2, atol=1e-2)  # fmt: skip


@pytest.mark.parametrize("kv", ["model", "int8", "int8-biased", "int8-biased-l64"])
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_flat_step_kernels_match_the_reference_attention(dtype, block_size, kv, monkeypatch):
    """The three launches of a mixed step (store_kv, decode rows, prompt-chunk tiles) against
    the pure-torch reference on the same cache: decode rows with long histories, chunks that
    start mid-row and span several tiles, a chunk of one token; rows on shuffled blocks of 16
    and on one block each; padding tokens (row -1) write nothing; the cache in the model's
    dtype and in int8 with a scale per token and head (int8: the decode rows by the exact loop,
    MPINFER_KV8_BIASED=0; int8-biased: by the biased route's packed PTX, the default; -l64: in
    tiles of 64 keys)."""
    from mpinfer.engine.runner import Layout, StepInputs
    from mpinfer.engine.step import Prefill, Step
    from mpinfer.model.attention import FlatBatch, KVCache, attend_kernels, attend_reference
    from mpinfer.model.bloom import BloomShape, alibi_slopes
    from mpinfer.model.kernels import attention

    monkeypatch.setattr(attention, "BIASED", kv.startswith("int8-biased"))
    monkeypatch.setattr(attention, "KV8_TILE_KEYS", 64 if kv.endswith("l64") else 32)

    shape = BloomShape(vocab_size=100, hidden_size=512, n_layer=1, n_head=4)  # head_dim 128
    heads, hd = 4, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    q8 = kv.startswith("int8")
    # The reference runs in fp32 on an fp32 copy of the cache (SDPA in bf16 rounds its own
    # softmax: 0.15 off on a 300-key row), so the bound below is the kernel's own rounding.
    caches = [KVCache.allocate(shape, 1, slots=6, max_seq=320, dtype=dt, device="cuda",
                               block_size=block_size, quantized=q8)
              for dt in (dtype, torch.float32)]  # fmt: skip
    if block_size:
        perm = torch.randperm(caches[0].tables.numel(), device="cuda", generator=g)
        for c in caches:
            c.tables = perm.view_as(c.tables)
    for a, b in zip(caches[1].k + caches[1].v, caches[0].k + caches[0].v):
        if q8:
            b.copy_(torch.randint(-127, 128, b.shape, device="cuda", generator=g))
        else:
            b.normal_(generator=g)
        a.copy_(b)
    if q8:  # scales of keys and values with magnitudes around 1
        for a, b in zip(caches[1].k_scale + caches[1].v_scale,
                        caches[0].k_scale + caches[0].v_scale):  # fmt: skip
            a.copy_(b.uniform_(0.5 / 127, 2 / 127, generator=g))
    step = Step(decode_slots=(4, 1, 5), decode_pos=(300, 7, 64),
                prefills=(Prefill(0, 0, tuple(range(150))), Prefill(2, 100, tuple(range(70))),
                          Prefill(3, 33, (9,))))  # fmt: skip
    lay = Layout.of(step)
    n = len(lay.ids)
    inputs = StepInputs.allocate(512, 6, "cuda")
    inputs.buf.copy_(torch.tensor(inputs.host(lay, step, pad=3), device="cuda"))
    ids, nxt, seq, pos, dec_seq, dec_pos, sample, tiles = inputs.views()
    qkv = torch.randn(512, heads * 3 * hd, device="cuda", dtype=dtype, generator=g)
    slopes = alibi_slopes(heads).cuda()
    batch = FlatBatch(seq, pos, dec_seq, dec_pos, tiles)
    out_k = attend_kernels(qkv, caches[0].layer(0), caches[0].tables, batch, slopes, heads, hd)
    ref_batch = FlatBatch(seq[:n], pos[:n], dec_seq[:3], dec_pos[:3], tiles, lay.segments(step))
    out_r = attend_reference(qkv[:n].float(), caches[1].layer(0), caches[1].tables, ref_batch,
                             slopes, heads, hd)  # fmt: skip
    # fp32 accumulation in the kernels; the probabilities meet V in the input dtype and the
    # output is rounded to it (bf16: 2^-8 relative, fp16: 2^-11; values are O(1)). int8: the
    # same dequantized values on both sides, but a value at a rounding tie may land one step
    # (1/127 of its row's largest) apart.
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    if q8:  # a tie rounded the other way moves one output by at most weight x one step (~0.03)
        off = ((out_k[:n].float() - out_r).abs() > max(tol, 3e-3) * (1 + out_r.abs())).float()
        assert off.mean() < 1e-3 and (out_k[:n].float() - out_r).abs().max() < 0.03
    else:
        torch.testing.assert_close(out_k[:n].float(), out_r, rtol=tol, atol=tol)
    # The same cache afterwards: every written key and value equal, nothing else touched.
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        if q8:
            diff = (a.int() - b.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        else:
            assert torch.equal(a, b.to(dtype))
    if q8:
        for a, b in zip(caches[0].k_scale + caches[0].v_scale,
                        caches[1].k_scale + caches[1].v_scale):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # the same inputs, fp32 math
