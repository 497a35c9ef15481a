"""Colours, labels and units shared by every picture (no matplotlib import here).

Palette: Okabe & Ito's colour-blind-safe set. Forward is a dark blue and backward a vermillion of
clearly different lightness; each later virtual stage (model chunk) on a rank is lighter and hatched,
so kinds and chunks stay apart in greyscale and for colour-blind readers.
"""
from __future__ import annotations

import re

from ..ir import Op

BASE = {
    Op.F: "#0072B2",  # blue
    Op.B: "#D55E00",  # vermillion
    Op.I: "#E69F00",  # orange
    Op.W: "#009E73",  # bluish green
    Op.R: "#CC79A7",  # reddish purple
}
KIND_NAME = {Op.F: "forward F", Op.B: "backward B", Op.I: "input grad I", Op.W: "weight grad W",
             Op.R: "recompute R"}
IDLE = "#f0f0f0"
COMM_WAIT = "#8c8c8c"  # hatch and edge of a communication wait
COMM_WAIT_FILL = "#c8c8c8"  # its fill: a wait too short for the hatch still shows as a thin grey mark
COMM_WAIT_LABEL = "comm wait: message in flight (thin grey mark if short)"
SENDING = "#4d4d4d"  # dark grey: the rank inside its own send call (a half-height bar in the idle gap)
SENDING_LABEL = "in send call"
ALL_REDUCE = "#000000"
TIE_REDUCE = "#6a3d9a"  # purple: the sum of a tied parameter's gradients over its ranks
DARK_TEXT = {Op.F, Op.B}  # kinds dark enough for white microbatch numbers on the first chunk
CHUNK_HATCH = ("", "////", "\\\\\\\\", "xxx")


def chunk_colour(op: Op, chunk: int, num_chunks: int) -> str:
    """The fill colour of ``op`` on virtual stage ``chunk`` of ``num_chunks``: lighter for later chunks."""
    base = BASE[op]
    if num_chunks <= 1 or chunk == 0:
        return base
    mix = 0.45 * chunk / (num_chunks - 1) + 0.1
    rgb = [int(base[i:i + 2], 16) for i in (1, 3, 5)]
    rgb = [round(c + (255 - c) * mix) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def chunk_hatch(chunk: int) -> str:
    """The hatch pattern of virtual stage ``chunk`` (none for the first)."""
    return CHUNK_HATCH[chunk % len(CHUNK_HATCH)]


def text_colour(op: Op, chunk: int) -> str:
    """The colour of the microbatch number inside a box of ``op`` on virtual stage ``chunk``: readable on its fill."""
    return "white" if op in DARK_TEXT and chunk == 0 else "black"


def time_unit(span: float) -> tuple[str, float]:
    """A readable unit for a span in seconds: ``(label, factor)`` with ``seconds * factor`` in that unit."""
    if span >= 1 or span <= 0:
        return "s", 1.0
    if span >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


# not "held after R=...B" (CostModel.describe's recompute_bytes: bytes, not seconds)
_TIME_COST = re.compile(r"(?<!after )\b(F|B|I|W|R)=(\[[^\]]*\]|[0-9.eE+-]+)")
_LATENCY = re.compile(r"\b(latency|send)=([0-9.eE+-]+)s\b")  # the message seconds: latency, send overhead
_BANDWIDTH = re.compile(r"\bbw=([0-9.eE+-]+)B/s\b")


def costs_drawn(text: str, drawn) -> str:
    """A :meth:`~pipesched.cost.CostModel.describe` line without the compute costs of kinds the picture has no box
    of (``drawn``: the :class:`~pipesched.ir.Op` of its events): a forward pass's ``B``, a split backward's fused
    ``B``, ``I``/``W`` without a split, ``R`` (and ``held after R``) without recompute; the seconds to 3
    significant digits (``0.0437395`` -> ``0.0437``), so a title of per-stage lists stays a few lines (the byte
    counts as they are)."""
    names = {op.name for op in drawn}

    def kept(match) -> str:
        if match.group(1) not in names:
            return ""
        values = match.group(2)
        short = ("[" + ",".join(_short(v) for v in values[1:-1].split(",")) + "]" if values.startswith("[")
                 else _short(values))
        return f"{match.group(1)}={short}"

    text = _TIME_COST.sub(kept, text)
    if "R" not in names:
        text = re.sub(r"held after R=\S+", "", text)
    return " ".join(text.split())


def _short(value: str) -> str:
    try:
        return f"{float(value):.3g}"
    except ValueError:
        return value


def cost_in_unit(text: str, unit: str, factor: float) -> str:
    """A :meth:`~pipesched.cost.CostModel.describe` line (seconds) in ``unit``, ``seconds * factor``:
    ``"F=0.001 B=0.002 latency=0.0001s send=2e-05s bw=2e+06B/s"`` in ms is ``"F=1 B=2 latency=0.1ms send=0.02ms
    bw=2e+03B/ms"``,
    so a picture whose time axis is in ms says ms everywhere. Parts it does not recognise stay as they are."""
    if factor == 1.0:
        return text

    def scale(value: str, by: float) -> str:
        try:
            return f"{float(value) * by:g}"
        except ValueError:
            return value

    def costs(match) -> str:
        value = match.group(2)
        if value.startswith("["):
            return f"{match.group(1)}=[" + ",".join(scale(v, factor) for v in value[1:-1].split(",")) + "]"
        return f"{match.group(1)}={scale(value, factor)}"

    text = _TIME_COST.sub(costs, text)
    text = _LATENCY.sub(lambda m: f"{m.group(1)}={scale(m.group(2), factor)}{unit}", text)
    return _BANDWIDTH.sub(lambda m: f"bw={float(m.group(1)) / factor:.3g}B/{unit}", text)
