"""The packed weight formats step.c reads: panels of float32, bf16 or int8 (quantised per output channel)."""

from __future__ import annotations

import torch

FMT_F32, FMT_BF16, FMT_I8, FMT_BF16_ROWS = 0, 1, 2, 3  # FMT_BF16_ROWS: a bf16 [out, in] matrix unpacked (LM heads)
_FMT_NAMES = {FMT_F32: "float32", FMT_BF16: "bf16", FMT_I8: "int8", FMT_BF16_ROWS: "bf16"}
PANEL = 16  # output columns per panel of a packed matrix (step.c's PW)
# a bf16 panel row stores column c at half 2c (c < 8) and 2(c - 8) + 1: step.c widens it with one shift
# and one mask (LOAD_BF16)
_BF16_ORDER = [c for i in range(8) for c in (i, i + 8)]


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of w is a bfloat16 widened to float32 (a model shipped in bf16 and run in
    float32): then its bf16 copy is lossless and step.c computes the very same products from half the bytes."""
    return bool(torch.equal(w.to(torch.bfloat16).to(torch.float32), w))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of w [out, in]: (q [out, in] int8, scale [out] float32) with
    w ~ q * scale. A row depends only on its own values, so a subset of rows (a draft vocabulary) gets the
    very values of the full matrix."""
    q, scale, _ = _quantize_rows(w, False)
    return q, scale


def _quantize_rows(w: torch.Tensor, sums: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize_int8's (q, scale), and with sums each row's sum of q (int32), taken while the row is at hand.

    In blocks of rows of about 4 MB of float32, each converted, scaled and rounded while it is in cache:
    over the whole matrix at once, five float32 passes through memory (and an int8 sum) took about 15 s of a
    1.5B model's int8 load. The values are the same: each row's scale and each weight's rounding are its own."""
    out, inp = w.shape
    q = torch.empty(out, inp, dtype=torch.int8)
    scale = torch.empty(out, dtype=torch.float32)
    # a float32 sum of at most 2^24 / 127 integers within +-127 is exact, in any order
    row_sums = torch.empty(out, dtype=torch.int32) if sums and inp * 127 < 1 << 24 else None
    step = max(1, (4 << 20) // (4 * max(inp, 1)))
    for a in range(0, out, step):
        x = w[a : a + step].to(torch.float32, copy=True)  # [rows, in], its own copy: rounded in place
        amax = x.abs().amax(dim=1)  # [rows]
        sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        torch.round(x.div_(sc[:, None]), out=x).clamp_(-127, 127)
        q[a : a + step] = x  # integers within +-127: exact in int8
        scale[a : a + step] = sc
        if row_sums is not None:
            row_sums[a : a + step] = x.sum(dim=1)
    if sums and row_sums is None:
        row_sums = q.sum(dim=1, dtype=torch.int32)
    return q, scale, row_sums


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights an int8 matrix stands for (tests and the PyTorch reference)."""
    return q.float() * scale[:, None]


def pack(w: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """A linear's weight [out, in] as step.c reads it: panels of PANEL output columns, each [in, PANEL]
    row-major, so a kernel streams its panel front to back; zero columns pad the last one. bf16: the
    same panels as bfloat16 bits (int16), columns in step.c's LOAD_BF16 order; w must be bf16_exact
    (or is rounded to bf16)."""
    return pack_as(w, FMT_BF16 if bf16 else FMT_F32)[0]


def pack_as(
    w: torch.Tensor, fmt: int, pairs: bool = False, quads: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [out, in] packed in format fmt: (panels, column scales padded to whole panels, int8 only).
    pairs (bf16, the AVX-512 build's layout): each panel as [ceil(in/2), PANEL, 2], column c's weights at
    k and k + 1 side by side (an odd in is padded with a zero k).
    quads (int8, the avx512-vnni build's layout): each panel as [ceil(in/4), PANEL, 4] (zero-padded k),
    and the scales followed by 128 * sum_k q[j, k] per padded column as int32 bits, which takes out the
    +128 offset of the u8 activations vpdpbusd multiplies."""
    out, inp = w.shape
    panels = -(-out // PANEL)
    # Each layout is one copy out of a [panels, PANEL, k] view of the padded matrix (a model's sizes are
    # mostly whole panels, so usually no padding copy either): packing a 1.5B model took 3.3 s of its
    # load with a gather over the transposed panels, and reordering whole rows first is 4x faster.
    if fmt == FMT_I8:
        q, scale, row_sums = _quantize_rows(w, quads)
        scales = torch.ones(panels * PANEL, dtype=torch.float32)
        scales[:out] = scale
        if quads:
            assert row_sums is not None  # asked for with quads
            in4 = -(-inp // 4) * 4
            q4 = _padded(q, panels * PANEL, in4)
            corr = torch.zeros(panels * PANEL, dtype=torch.int32)  # [panels * PANEL]: padded columns sum to 0
            corr[:out] = row_sums * 128
            packed = q4.view(panels, PANEL, in4 // 4, 4).transpose(1, 2).contiguous()  # [panels, in4/4, PANEL, 4]
            return packed, torch.cat([scales, corr.view(torch.float32)])
        return _padded(q, panels * PANEL, inp).view(panels, PANEL, inp).transpose(1, 2).contiguous(), scales
    if fmt == FMT_F32:
        return _padded(w.float(), panels * PANEL, inp).view(panels, PANEL, inp).transpose(1, 2).contiguous(), None
    src = w.to(torch.bfloat16)  # a bf16 model's own values as they are; float32 rounded to bf16
    if pairs:
        in2 = inp + inp % 2
        pairs_ = _padded(src, panels * PANEL, in2).view(panels, PANEL, in2 // 2, 2).transpose(1, 2)
        return pairs_.contiguous().view(torch.int16), None  # [panels, in/2, PANEL, 2]
    rows = _padded(src, panels * PANEL, inp).view(panels, PANEL, inp)[:, _BF16_ORDER]  # each panel's rows in
    return rows.transpose(1, 2).contiguous().view(torch.int16), None  # LOAD_BF16's order


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [r, c] zero-padded to [rows, cols] (t itself, contiguous, when it is that size already)."""
    if t.shape == (rows, cols):
        return t.contiguous()
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _format_for(weights: str, mats: tuple[torch.Tensor, ...]) -> int:
    """The panel format of a group of matrices under the weights setting: auto keeps the values (bf16
    panels when every value is a bf16, float32 otherwise), bf16 rounds, int8 quantises."""
    if weights == "int8":
        return FMT_I8
    if weights == "float32":  # float32 panels whatever the values (tests compare them with bf16 panels)
        return FMT_F32
    if weights == "bf16" or all(w.dtype == torch.bfloat16 or bf16_exact(w) for w in mats):
        return FMT_BF16
    return FMT_F32
