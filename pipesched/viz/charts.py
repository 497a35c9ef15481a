"""Bubble fraction vs number of microbatches for every built-in schedule: simulated points, closed-form curves."""
from __future__ import annotations

import ast
import operator

from ..api import compile_program
from ..cost import CostModel
from ..errors import ScheduleError
from ..schedules import SCHEDULES
from ..sim import simulate

#: a power in floats: p**p**p in integers took unbounded time and memory; in floats it overflows at once (None)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Mod: operator.mod, ast.Pow: lambda a, b: float(a) ** b, ast.Eq: operator.eq, ast.NotEq: operator.ne,
        ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")


def closed_form_bubble(formula: str, p: int, m: float, v: int = 1) -> float | None:
    """Evaluate a registry closed form such as ``"(p-1)/(v*m+p-1) for m % p == 0"`` at (p, m, v).

    Only arithmetic on ``p``, ``m``, ``v`` and numbers is accepted. A trailing ``for CONDITION`` is
    checked when ``m`` is an integer; the value is returned only where the condition holds.

    Returns:
        The bubble fraction (0..1), or ``None`` when the text is not such a formula (e.g. prose), the
        condition fails, or the value is no real number (an overflow, a complex power).
    """
    expression, _, condition = formula.partition(" for ")
    names = {"p": p, "m": m, "v": v}
    try:
        if condition and float(m).is_integer() and not _evaluate(condition.strip(), names):
            return None
        value = _evaluate(expression.strip(), names)
    except (ValueError, ZeroDivisionError, SyntaxError, OverflowError):
        return None
    return float(value) if isinstance(value, (int, float)) else None  # a negative base's fractional power: complex


def plot_bubble_vs_microbatches(num_ranks: int = 4, microbatches=None, schedules=None,
                                cost: CostModel | None = None, ax=None):
    """Bubble fraction against microbatches per step for each schedule at ``num_ranks`` ranks.

    Markers are simulated bubbles (:func:`pipesched.simulate` of the compiled program with ``cost``,
    default F=1 B=2, each schedule at its default virtual stages); lines of the same colour are the
    registry's closed forms, drawn over continuous m, or, for a form with a ``for`` condition (shown in the
    legend), as small filled dots only at the m where it holds (interleaved: multiples of p). Coincident
    schedules show as nested hollow markers, each schedule's drawn a few points to the side of the last (centred on
    m; the data keeps the exact m), so none hides another. A schedule whose size is invalid at some m skips that
    point.

    Args:
        num_ranks: pipeline ranks ``p`` >= 1.
        microbatches: the m values to simulate; default 1..4p.
        schedules: registry names; default every built-in schedule.
        cost: the cost model (seconds); the closed forms assume uniform costs and free messages.
        ax: Axes to draw into; ``None`` makes a new headless (Agg) figure.
    Returns:
        The ``matplotlib.figure.Figure``.
    Raises:
        UnknownScheduleError: a name in ``schedules`` is not registered.
        ValueError: ``num_ranks`` < 1 or no microbatch values.
    """
    from ..schedules import get_schedule

    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    ms = list(range(1, 4 * num_ranks + 1) if microbatches is None else microbatches)
    if not ms:
        raise ValueError("microbatches is empty")
    infos = [get_schedule(name) for name in (schedules or SCHEDULES)]
    fig, ax = _figure(ax)
    cost = cost or CostModel()
    for index, info in enumerate(infos):
        colour, marker = COLOURS[index % len(COLOURS)], MARKERS[index % len(MARKERS)]
        v = info.default_virtual_stages
        label = info.name + (f" (v={v})" if v > 1 else "")
        points = simulated_bubbles(info.name, num_ranks, ms, v, cost)
        ax.plot([m for m, _ in points], [b for _, b in points], linestyle="none", marker=marker,
                markersize=max(4.0, 10.0 - 2.5 * index), markerfacecolor="none", markeredgewidth=1.4,
                color=colour, label=f"{label}: simulated", gid=f"sim:{info.name}",
                transform=_nudged(ax, index, len(infos)))
        _closed_form_curve(ax, info, num_ranks, ms, v, colour, index)
    ax.set_xlabel("microbatches per step m")
    ax.set_ylabel("bubble fraction (idle / (p × makespan))")
    ax.set_ylim(0, 1)
    ax.set_xlim(min(ms) - 0.5, max(ms) + 0.5)
    ax.grid(color="#e0e0e0", linewidth=0.5)
    ax.set_title(f"Bubble fraction vs microbatches at p={num_ranks} ranks — costs: {cost.describe()}",
                 fontsize=10, loc="left")
    ax.legend(fontsize=7.5, frameon=False, ncol=1, loc="upper right")
    return fig


def _nudged(ax, index: int, count: int):
    """Data coordinates drawn ``_NUDGE_PT`` points apart per schedule, centred on each m: schedules whose bubbles
    coincide (zbv and dualpipev) stay visible side by side; the points' data (``get_data``) keeps the exact m."""
    from matplotlib.transforms import ScaledTranslation

    shift = (index - (count - 1) / 2) * _NUDGE_PT / 72  # inches
    return ax.transData + ScaledTranslation(shift, 0, ax.figure.dpi_scale_trans)


_NUDGE_PT = 2.5  #: points between the markers of neighbouring schedules at one m


def simulated_bubbles(schedule: str, num_ranks: int, ms, v: int, cost: CostModel) -> list[tuple[int, float]]:
    """``[(m, simulated bubble fraction)]`` for each ``m`` the schedule accepts."""
    points = []
    for m in ms:
        try:
            program = compile_program(schedule, num_ranks, m, v)
        except ScheduleError:
            continue
        points.append((m, simulate(program, cost, check=False).bubble_fraction))
    return points


def _closed_form_curve(ax, info, p: int, ms, v: int, colour: str, index: int) -> None:
    """The registry's closed form: a curve over continuous m when it holds for every m; with a ``for``
    condition (interleaved: ``m % p == 0``) only at the integer m in range where it holds, as filled dots
    (no line: a chord between them would pass beside exact points), so that the simulated points where it
    does not hold (m < p) are not read as off the curve."""
    import numpy as np

    expression, _, condition = info.bubble.partition(" for ")
    style = ("-", "--", "-.", ":")[index % 4]
    if condition:
        xs = [m for m in range(int(np.ceil(min(ms))), int(max(ms)) + 1)
              if closed_form_bubble(info.bubble, p, m, v) is not None]
        ys = [closed_form_bubble(info.bubble, p, m, v) for m in xs]
        style, marker = "none", "o"
    else:
        xs = np.linspace(min(ms), max(ms), 200)
        ys = [closed_form_bubble(expression, p, float(x), v) for x in xs]
        marker = None
    if not len(xs) or any(y is None for y in ys):
        return
    ax.plot(xs, ys, linestyle=style, linewidth=1.2, color=colour, alpha=0.8, marker=marker, markersize=3,
            label=f"{info.name}: closed form {info.bubble}" + (" (drawn where it holds)" if condition else ""),
            gid=f"closed:{info.name}")


def _figure(ax):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _evaluate(text: str, names: dict):
    return _node(ast.parse(text, mode="eval").body, names)


def _node(node, names):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_node(node.left, names), _node(node.right, names))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_node(node.operand, names)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPS:
        return _OPS[type(node.ops[0])](_node(node.left, names), _node(node.comparators[0], names))
    raise ValueError(f"not a closed-form expression: {ast.dump(node)}")
