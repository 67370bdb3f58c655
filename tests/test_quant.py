"""int8 format and the linear methods, against pure-torch references on fresh random inputs."""

import pytest
import torch

from mpinfer.model.quant import (
    BnbInt8Method,
    DenseMethod,
    Int8Method,
    dequantize_rows,
    int8_linear_reference,
    quantize_rows,
)


@pytest.mark.parametrize("shape", [(7, 13), (64, 64), (3, 1000)])
def test_quantize_rows_error_is_half_a_step(shape):
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 10
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    # Rounding to the nearest of 255 levels: at most half a step (scale/2) per element.
    err = (dequantize_rows(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-6)
    assert q.abs().amax(1).eq(127).all()  # each row's absmax uses the full range


def test_zero_rows_stay_zero():
    q, scale = quantize_rows(torch.zeros(3, 5))
    assert torch.all(q == 0) and torch.all(dequantize_rows(q, scale) == 0)


def make_layer(method, out_f, in_f, w):
    layer = torch.nn.Module()  # stands in for a TP layer: the method only sets its parameters
    method.create_weights(layer, out_f, in_f, torch.float32)
    if isinstance(method, DenseMethod):
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
    else:
        q, s = quantize_rows(w)
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(s, requires_grad=False)
    method.after_load(layer)
    return layer


@pytest.mark.parametrize("out_f, in_f, batch", [(33, 17, 1), (128, 64, 5), (10, 300, 3)])
def test_int8_method_equals_dequantized_dense(out_f, in_f, batch):
    w, x, b = torch.randn(out_f, in_f), torch.randn(batch, in_f), torch.randn(out_f)
    layer = make_layer(Int8Method(), out_f, in_f, w)
    expected = x @ dequantize_rows(layer.weight, layer.weight_scale).T + b
    torch.testing.assert_close(Int8Method().apply(layer, x, b), expected, atol=1e-4, rtol=1e-4)
    rows = Int8Method().weight_rows(layer, torch.tensor([0, out_f - 1]))
    torch.testing.assert_close(rows, dequantize_rows(layer.weight, layer.weight_scale)[[0, -1]])
    # (x @ q) * scale and x @ (q * scale) round differently: fp32 sums of in_f products of size
    # ~sqrt(in_f) differ by up to ~eps * in_f, above assert_close's fp32 default (1e-5) at 300.
    torch.testing.assert_close(
        int8_linear_reference(x, layer.weight, layer.weight_scale, None),
        expected - b,
        atol=1e-4,
        rtol=1e-4,
    )


def test_bnb_llm_int8_is_close_to_dense_with_outliers():
    torch.manual_seed(0)
    w, x = torch.randn(64, 128) * 0.1, torch.randn(4, 128)
    x[:, 7] *= 30  # an outlier feature column, the case LLM.int8() decomposes
    layer = make_layer(BnbInt8Method(threshold=6.0), 64, 128, w)
    y = BnbInt8Method(threshold=6.0).apply(layer, x, None)
    rel = (y - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < 0.02, rel


@pytest.mark.parametrize("sms", [78, 132])
def test_attention_splits_fill_the_gpu_without_tiny_programs(sms):
    """The decode attention's programs per row and head (tuning.attention_splits): about 8 per
    SM across batch x heads and at least ATTN_MIN_SPLITS (mixed histories even out over more,
    shorter programs), capped by the cache's 32-key tiles and by 32, never fewer splits than
    that allows, and fewer (longer) splits, not more, as the batch grows."""
    from mpinfer.model.kernels.tuning import ATTN_MIN_SPLITS, attention_splits

    assert ATTN_MIN_SPLITS == 8  # the shipped policy (MPINFER_ATTN_MIN_SPLITS unset)
    for heads in (14, 32, 112):
        for max_seq in (1, 64, 128, 129, 576, 2048, 4096):
            cap = max(1, min(-(-max_seq // 32), 32))
            previous = cap
            for batch in (1, 2, 5, 8, 32, 64):
                splits = attention_splits(batch, heads, max_seq, sms)
                assert min(ATTN_MIN_SPLITS, cap) <= splits <= cap, (batch, heads, max_seq)
                programs = batch * heads * splits
                assert programs >= min(8 * sms, batch * heads * cap), (batch, heads, max_seq)
                if splits > ATTN_MIN_SPLITS:  # never more than ~8 per SM needs
                    assert batch * heads * (splits - 1) < 8 * sms
                assert splits <= previous
                previous = splits
    assert attention_splits(1, 32, 2048, 132) == 32  # batch 1: capped at 32
    assert attention_splits(32, 32, 2048, 132) == 8  # was 2: the floor of 8
    assert attention_splits(64, 112, 2048, 132) == 8
    assert attention_splits(32, 32, 128, 132) == 4  # a 128-token cache has 4 tiles
    assert attention_splits(1, 14, 576, 132) == 18  # capped by the cache's 18 tiles
