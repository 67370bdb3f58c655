"""The int8 matmul's conversions of weights to float (w8a16.py's and w8a16_tma.py's loops):
packed PTX and its Triton-op twins, by the config's MAGIC (`_to_compute`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import INTERPRETED

# Packed int8 conversions in PTX, four weights per call (MAGIC=2; NVIDIA only). One `xor` makes
# the four signed bytes offset-binary (q + 128); `prmt` then places each byte under a constant
# exponent, so the bits are a float whose value is a fixed offset plus q + 128, and one subtract
# (two lanes at a time for fp16) leaves q exactly. No conversion-unit instruction (the int8 ->
# float conversion runs at 16 values per clock per SM on Hopper, about the rate the weight bytes
# arrive at), and no per-byte unpacking: 5 instructions per 4 weights for fp16, 9 for fp32.
# fp16: 0x64XX is 1024 + XX, so subtract 1152 (0x6480) from both lanes.
_S8_TO_F16 = tl.constexpr("""{
.reg .b32 u, c;
xor.b32 u, $2, 0x80808080;
prmt.b32 $0, u, 0x64646464, 0x4140;
prmt.b32 $1, u, 0x64646464, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}""")
# fp32: 0x4B0000XX is 2^23 + XX, so subtract 2^23 + 128.
_S8_TO_F32 = tl.constexpr("""{
.reg .b32 u;
xor.b32 u, $4, 0x80808080;
prmt.b32 $0, u, 0x4B000000, 0x7540;
prmt.b32 $1, u, 0x4B000000, 0x7541;
prmt.b32 $2, u, 0x4B000000, 0x7542;
prmt.b32 $3, u, 0x4B000000, 0x7543;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}""")
# bf16: the fp32 values' upper halves, exact for integers of at most 8 significant bits.
_S8_TO_BF16 = tl.constexpr("""{
.reg .b32 u, f<4>;
xor.b32 u, $2, 0x80808080;
prmt.b32 f0, u, 0x4B000000, 0x7540;
prmt.b32 f1, u, 0x4B000000, 0x7541;
prmt.b32 f2, u, 0x4B000000, 0x7542;
prmt.b32 f3, u, 0x4B000000, 0x7543;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}""")


# MAGIC=6, two weights per call (fp16, the swap loop): there each thread's tensor-core fragment
# holds its weights in pairs (two adjacent K positions), loaded two bytes at a time; four-at-a-
# time conversion first packs two such pairs into one register, which in Triton 3.6's code for
# that loop cost more instructions (byte moves) than the conversion itself. This one takes a
# pair as it was loaded: 4 instructions per 2 weights, no packing.
_S8X2_TO_F16 = tl.constexpr("""{
.reg .b32 u, c;
cvt.u32.u16 u, $1;
xor.b32 u, u, 0x8080;
prmt.b32 $0, u, 0x64646464, 0x4140;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
}""")
# Under Triton's interpreter (launch.INTERPRETED) MAGIC 2 and 6 run MAGIC 1's Triton ops.


@triton.jit
def _to_compute(w, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """An int8 tile as `dtype` (fp16, bf16, or fp32 for the one-row loop), by MAGIC's route."""
    if MAGIC == 6 and not INTERPRETED:
        return tl.inline_asm_elementwise(_S8X2_TO_F16, "=r,h", [w], dtype=tl.float16,
                                         is_pure=True, pack=2)  # fmt: skip
    elif MAGIC == 2 and not INTERPRETED:
        if dtype == tl.float16:
            return tl.inline_asm_elementwise(_S8_TO_F16, "=r,=r,r", [w], dtype=tl.float16,
                                             is_pure=True, pack=4)  # fmt: skip
        elif dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(_S8_TO_BF16, "=r,=r,r", [w], dtype=tl.bfloat16,
                                             is_pure=True, pack=4)  # fmt: skip
        else:
            return tl.inline_asm_elementwise(_S8_TO_F32, "=r,=r,=r,=r,r", [w], dtype=tl.float32,
                                             is_pure=True, pack=4)  # fmt: skip
    elif MAGIC == 1 or MAGIC == 2 or MAGIC == 6:
        # The same fp16 trick in Triton's elementwise ops, one weight at a time: the bytes of
        # q + 128, OR-ed into the mantissa of 1024.0, are the fp16 number 1024 + q + 128;
        # subtract 1152 (exact, as is its move to bf16 or fp32).
        bits = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16) | 0x6400
        y = bits.to(tl.float16, bitcast=True) - 1152.0
        return y.to(dtype)
    else:
        # Through fp32: int8 -> fp16 directly is a slow conversion on Hopper (the bf16 route,
        # which goes through fp32 anyway, measured up to 15 % faster); fp32 -> 16 bit is a fast
        # paired conversion.
        return w.to(tl.float32).to(dtype)
