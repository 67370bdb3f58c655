"""The int4 kernel's conversions (w4a16.py): how packed nibbles become numbers the loops can
multiply, in packed PTX for the GPU and in Triton ops for Triton's interpreter (CPU CI), one
function per MAGIC of the config names (tuning.py). w4a16.py's docstring says what each does
and where it won; the comments here say how, instruction by instruction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import INTERPRETED

# Four packed bytes (eight nibbles) to their weights q * s + z in fp16 (MAGIC=2), two lanes an
# instruction. `prmt` spreads bytes 0, 1 (then 2, 3) into the low byte of each 16-bit lane; one
# `lop3` per nibble keeps the nibble and ORs in the exponent of 1024, so a lane is the fp16
# number 1024 + q (low nibble) or 1024 + 16 q (high nibble); a subtract, or a multiply-add by
# 1/16 and -64, leaves q exactly, and one multiply-add applies the lane's scale and offset (one
# rounding). Operands: $0-$1 the four low-nibble weights, $2-$3 the high ones, $4 the bytes,
# $5-$6 the scales, $7-$8 the offsets.
_U4_TO_F16 = tl.constexpr("""{
.reg .b32 t0, t1, a0, a1, a2, a3, k, m, c;
mov.b32 k, 0x64006400;
mov.b32 m, 0x2C002C00;
mov.b32 c, 0xD400D400;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 a0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, t1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a2, t0, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 a3, t1, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 a0, a0, k;
sub.f16x2 a1, a1, k;
fma.rn.f16x2 a2, a2, m, c;
fma.rn.f16x2 a3, a3, m, c;
fma.rn.f16x2 $0, a0, $5, $7;
fma.rn.f16x2 $1, a1, $6, $8;
fma.rn.f16x2 $2, a2, $5, $7;
fma.rn.f16x2 $3, a3, $6, $8;
}""")

# Four packed bytes to their eight nibbles as fp32 numbers 1 + q/128 (low nibbles, $0-$3) and
# 1 + q/2048 (high, $4-$7), MAGIC=4: one `prmt` copies byte j into bytes 1 and 2 of a zero
# word, then one `lop3` a nibble keeps it (bits 16-19 or 12-15) under the bits of 1.0f.
_U4_TO_F32 = tl.constexpr(
    "{\n.reg .b32 t;\n"
    + "".join(
        f"""prmt.b32 t, $8, 0, 0x4{j}{j}4;
lop3.b32 ${j}, t, 0x000F0000, 0x3F800000, 0xEA;
lop3.b32 ${4 + j}, t, 0x0000F000, 0x3F800000, 0xEA;
"""
        for j in range(4)
    )
    + "}"
)


# Two packed bytes (four nibbles: two low, two high) as fp16 pairs of q (MAGIC=7, the swap loop,
# fp16 only), from the tensor-core fragment's pair of adjacent K positions as loaded (no packing,
# like int8's magic6): `prmt` puts byte j under lane j, one `lop3` a nibble ORs in the exponent
# of 1024 (1024 + q low, 1024 + 16 q high), and a subtract or a multiply-add by 1/16 and -64
# leaves q exactly: 1.5 instructions a weight, no scale or offset in them. The group's scale and
# offset are applied to the tensor cores' sums instead, s * sum(q x) + z * sum(x), once per group
# and output; sum(x), each row's sum over each group, is one small reduction before the launch
# (`w4a16_matmul`), read by every program.
_U4X2_TO_F16 = tl.constexpr("""{
.reg .b32 u, t, a, b, k, m, c;
mov.b32 k, 0x64006400;
mov.b32 m, 0x2C002C00;
mov.b32 c, 0xD400D400;
cvt.u32.u16 u, $2;
prmt.b32 t, u, 0, 0x4140;
lop3.b32 a, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b, t, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 $0, a, k;
fma.rn.f16x2 $1, b, m, c;
}""")

# Four words of packed bytes (32 weights of a row: a word's four low nibbles pair with four
# consecutive halves of x's low half, its high nibbles with the same four of the high half)
# times their activations, in packed fp16 (MAGIC=8, the one-row loop, fp16 only). Per word:
# two `prmt` put bytes 0, 1 (then 2, 3) under the low byte of each 16-bit lane, one `lop3` a
# nibble ORs in the exponent of 1024, and a multiply-add leaves u = (q - 8) / 16 exactly (low:
# (1024 + q) / 16 - 64.5; high: (1024 + 16 q) / 256 - 4.5), and one `fma.f16x2` a pair
# multiplies it by x and adds it to one of two fp16 pair sums (words 0-1, 2-3: eight products a
# lane). The four lanes, widened, are the outputs; their sum is the run's sum of u x. 1.9
# instructions a weight, no scale or offset in them: the group's are applied to the run's sums,
# 16 s * sum(u x) + 16 (z + 8 s) * sum(x / 16). Centred and scaled, |u| <= 1/2 keeps the fp16
# sums (8 |x| / 2 at most) from overflow for any |x| under 16,000. Operands: $0-$3 the outputs,
# $4-$7 the words, then x as fp16 pairs: $8-$11 halves 0-1 of each word's four low ones,
# $12-$15 halves 2-3, $16-$19 and $20-$23 the same of the high ones.
# The two fp16 pair sums s0, s1 widened to the four fp32 outputs $0-$3 (both asm blocks end so).
_WIDEN = """mov.b32 {h0, h1}, s0;
mov.b32 {h2, h3}, s1;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}"""


def _u4w_half(i: int, sel: str, lo: int, hi: int) -> str:
    """Word i's bytes under `sel` (0, 1 or 2, 3) times x's pairs $lo (low) and $hi (high)."""
    return f"""prmt.b32 t, ${4 + i}, 0, {sel};
lop3.b32 a, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 c, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 a, a, k, o;
fma.rn.f16x2 c, c, m, n;
fma.rn.f16x2 s{i // 2}, a, ${lo}, s{i // 2};
fma.rn.f16x2 s{i // 2}, c, ${hi}, s{i // 2};
"""


_U4W_DOT = tl.constexpr("""{
.reg .b32 t, a, c, k, m, n, o, s0, s1;
.reg .b16 h0, h1, h2, h3;
mov.b32 k, 0x2C002C00;
mov.b32 o, 0xD408D408;
mov.b32 m, 0x1C001C00;
mov.b32 n, 0xC480C480;
mov.b32 s0, 0;
mov.b32 s1, 0;
""" + "".join(_u4w_half(i, "0x4140", 8 + i, 16 + i) + _u4w_half(i, "0x4342", 12 + i, 20 + i)
              for i in range(4)) + _WIDEN)  # fmt: skip

# The same four words' activations summed (MAGIC=8's sum(x / 16) of a run, shared by every row
# of a thread): fp16 pair sums of words 0-1 and 2-3, widened. Operands: $0-$3 the outputs, $4-$19
# x's pairs as in _U4W_DOT.
_X4W_SUM = tl.constexpr("""{
.reg .b32 k, s0, s1;
.reg .b16 h0, h1, h2, h3;
mov.b32 k, 0x2C002C00;
mov.b32 s0, 0;
mov.b32 s1, 0;
""" + "".join(f"fma.rn.f16x2 s{i // 2}, ${4 + i + 4 * q}, k, s{i // 2};\n"
              for i in range(4) for q in range(4)) + _WIDEN)  # fmt: skip
_U4W_DOT_REGS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 20))
_X4W_SUM_REGS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))

# Under Triton's interpreter (launch.INTERPRETED) MAGIC 5 makes its mantissas in Triton ops
# (MAGIC 3's way), MAGIC 7 its q with Triton's casts, and MAGIC 8 its words' sums in fp32.


@triton.jit
def _pairs(b):
    """MAGIC 7: a (rows, G/2) tile of packed bytes as its two halves of q, exact in fp16."""
    if INTERPRETED:
        return (b & 0xF).to(tl.float16), (b >> 4).to(tl.float16)
    return tl.inline_asm_elementwise(
        _U4X2_TO_F16, "=r,=r,h", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
    )


@triton.jit
def _mantissas(b, PTX: tl.constexpr):
    """Packed bytes (rows, G/2) as the fp32 numbers 1 + q/128 (low nibbles) and 1 + q/2048
    (high), each nibble under the mantissa of 1.0: in PTX (MAGIC 4) or in Triton ops (3)."""
    if PTX:
        return tl.inline_asm_elementwise(
            _U4_TO_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float32, tl.float32),
            is_pure=True, pack=4,
        )  # fmt: skip
    b32 = b.to(tl.uint32)
    m_lo = (((b32 & 0xF) << 16) | 0x3F800000).to(tl.float32, bitcast=True)
    m_hi = (((b32 & 0xF0) << 8) | 0x3F800000).to(tl.float32, bitcast=True)
    return m_lo, m_hi


@triton.jit
def _nibbles(b, s, z, dtype: tl.constexpr, MAGIC: tl.constexpr):
    """A (rows, G/2) tile of packed bytes as its two (rows, G/2) halves of weights in `dtype`:
    q * s + z, s and z (rows, 1) fp16."""
    if MAGIC >= 3:  # fp32 weights with no conversion (one-row loop): the module's docstring
        m_lo, m_hi = _mantissas(b, MAGIC == 4)
        s_lo = s.to(tl.float32) * 128.0
        s_hi = s.to(tl.float32) * 2048.0
        z32 = z.to(tl.float32)
        return (m_lo * s_lo + (z32 - s_lo)).to(dtype), (m_hi * s_hi + (z32 - s_hi)).to(dtype)
    if MAGIC == 2:
        lo, hi = tl.inline_asm_elementwise(_U4_TO_F16, "=r,=r,=r,=r,r,r,r,r,r", [b, s, z],
                                           dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=4)  # fmt: skip
        return lo.to(dtype), hi.to(dtype)
    lo = b & 0xF
    hi = b >> 4
    if MAGIC == 1:
        flo = (lo.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        fhi = (hi.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        return (flo * s + z).to(dtype), (fhi * s + z).to(dtype)
    s32, z32 = s.to(tl.float32), z.to(tl.float32)
    return ((lo.to(tl.float32) * s32 + z32).to(dtype),
            (hi.to(tl.float32) * s32 + z32).to(dtype))  # fmt: skip


# MAGIC 5 sums this many consecutive products of mantissas and activations (one thread's run of
# packed bytes: the one-row loop's loads are 8 bytes wide) before the group's scale and offset
# are applied, once per run instead of once per weight.
FACTOR_RUN = tl.constexpr(8)


@triton.jit
def _factored(b, s, z, x_lo, x_hi, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """A group's contribution to the one-row loop's (BLOCK_N, HALF / FACTOR_RUN) sums, with the
    scale and offset factored out of the products (MAGIC 5). With m = 1 + q/128 (low nibbles)
    and 1 + q/2048 (high), the fp32 numbers MAGIC 4 makes without conversion, a run's sum is

        sum (q s + z) x = s (128 P_lo + 2048 P_hi - X_w) + z X_s
        P = sum m x (per row),  X_w = sum 128 x_lo + 2048 x_hi,  X_s = sum x_lo + x_hi

    (X per run, shared by every row): one fma a weight and a few per run of eight, instead of
    two a weight. P's rounding is relative to |x| where q's part is q/128 (q/2048) of it: at
    most 2^-24 * 2048 / q of a product, under fp16's rounding of the weight that MAGIC 2
    makes."""
    m_lo, m_hi = _mantissas(b, not INTERPRETED)
    RUNS: tl.constexpr = HALF // FACTOR_RUN
    p_lo = tl.sum(tl.reshape(m_lo * x_lo[None, :], (BLOCK_N, RUNS, FACTOR_RUN)), axis=2)
    p_hi = tl.sum(tl.reshape(m_hi * x_hi[None, :], (BLOCK_N, RUNS, FACTOR_RUN)), axis=2)
    # (1, RUNS): summed in the products' layout, so no thread waits for another
    xs_lo = tl.sum(tl.reshape(x_lo[None, :], (1, RUNS, FACTOR_RUN)), axis=2)
    xs_hi = tl.sum(tl.reshape(x_hi[None, :], (1, RUNS, FACTOR_RUN)), axis=2)
    x_w = 128.0 * xs_lo + 2048.0 * xs_hi
    x_s = xs_lo + xs_hi
    s32, z32 = s.to(tl.float32), z.to(tl.float32)  # (BLOCK_N, 1)
    return s32 * (128.0 * p_lo + 2048.0 * p_hi - x_w) + z32 * x_s


# MAGIC 8 takes a row's bytes four at a time (32-bit words) and x four halves at a time (64-bit
# words), in runs of WORD_RUN words (16 bytes: one load a row): the packed asm's unit.
WORD_RUN = tl.constexpr(4)


@triton.jit
def _halves(x, j):
    """Half j (0-3) of 64-bit words of x, as fp32 (MAGIC 8 under the interpreter)."""
    return ((x >> (16 * j)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair(x, j):
    """Pair j (0: halves 0-1, 1: halves 2-3) of 64-bit words of four fp16 halves, as 32-bit
    words (a register each: no 64-bit operand for the asm to unpack per row)."""
    return ((x >> (32 * j)) & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _word_dots(w, xl, xh):
    """MAGIC 8: (rows, words) of packed bytes (int32) and x's matching (1, words) low and high
    halves (int64, four a word) as fp32 numbers whose sum over each run of WORD_RUN words is
    the run's sum of (q - 8) / 16 * x."""
    if INTERPRETED:
        acc = tl.zeros(w.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            lo = ((w >> (8 * j)) & 0xF).to(tl.float32) - 8.0
            hi = ((w >> (8 * j + 4)) & 0xF).to(tl.float32) - 8.0
            acc += lo * _halves(xl, j) + hi * _halves(xh, j)
        return acc * 0.0625
    return tl.inline_asm_elementwise(
        _U4W_DOT, _U4W_DOT_REGS,
        [w, _pair(xl, 0), _pair(xl, 1), _pair(xh, 0), _pair(xh, 1)], dtype=tl.float32,
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _word_sums(xl, xh):
    """MAGIC 8: (1, words) of x's low and high halves as fp32 numbers whose sum over each run
    of WORD_RUN words is the run's sum of x / 16."""
    if INTERPRETED:
        acc = tl.zeros(xl.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            acc += _halves(xl, j) + _halves(xh, j)
        return acc * 0.0625
    return tl.inline_asm_elementwise(
        _X4W_SUM, _X4W_SUM_REGS,
        [_pair(xl, 0), _pair(xl, 1), _pair(xh, 0), _pair(xh, 1)], dtype=tl.float32,
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _word_group(w, s, z, xl, xh, BLOCK_N: tl.constexpr, GP: tl.constexpr, WORDS: tl.constexpr):
    """GP groups' contribution to MAGIC 8's (BLOCK_N, GP, runs) sums: 16 s * sum((q - 8) / 16
    * x) + 16 (z + 8 s) * sum(x / 16) a run; w (BLOCK_N, GP, WORDS), x's (1, GP, WORDS), s and
    z (BLOCK_N, GP) fp16."""
    RUNS: tl.constexpr = WORDS // WORD_RUN
    p = tl.sum(tl.reshape(_word_dots(w, xl, xh), (BLOCK_N, GP, RUNS, WORD_RUN)), axis=3)
    xs = tl.sum(tl.reshape(_word_sums(xl, xh), (1, GP, RUNS, WORD_RUN)), axis=3)
    s16 = s.to(tl.float32) * 16.0
    z16 = z.to(tl.float32) * 16.0 + 8.0 * s16
    return s16[:, :, None] * p + z16[:, :, None] * xs


@triton.jit
def _word_group_xs(w, s, z, xl, xh, xg, BLOCK_N: tl.constexpr, GP: tl.constexpr,
                   WORDS: tl.constexpr):  # fmt: skip
    """MAGIC 9: _word_group with each group's sum of x given (xg, (GP,) fp32, summed by the
    launcher): (z + 8 s) * sum(x) spread evenly over the group's runs, and no x work in the
    loop but the products."""
    RUNS: tl.constexpr = WORDS // WORD_RUN
    p = tl.sum(tl.reshape(_word_dots(w, xl, xh), (BLOCK_N, GP, RUNS, WORD_RUN)), axis=3)
    s32 = s.to(tl.float32)
    zx = (z.to(tl.float32) + 8.0 * s32) * (xg * (1.0 / RUNS))[None, :]
    return (16.0 * s32)[:, :, None] * p + zx[:, :, None]
