"""Pictures of timelines: Gantt charts, simulated-vs-measured comparisons, Chrome traces, bubble charts.

Importing this package is cheap: matplotlib is imported only when something is drawn, so
``pipesched.cli`` can register the ``render`` subcommand without loading it. Drawing uses the Agg
backend on a ``matplotlib.figure.Figure`` (no pyplot, no display needed).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "plot_timeline": "gantt",
    "plot_comparison": "compare",
    "predict_for": "compare",
    "fit_cost": "compare",
    "simulate_like": "compare",
    "write_chrome_trace": "trace",
    "bubble_breakdown": "analysis",
    "communication_waits": "analysis",
    "send_intervals": "analysis",
    "send_seconds": "analysis",
    "to_chrome_trace": "trace",
    "save_chrome_trace": "trace",
    "plot_bubble_vs_microbatches": "charts",
    "closed_form_bubble": "charts",
    "build_gallery": "gallery",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
