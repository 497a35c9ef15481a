"""The cost-model options of the ``pipesched`` commands that compile or simulate a schedule (``show``, ``simulate``,
``render``): one option per :class:`~pipesched.cost.CostModel` field, parsed into one, with errors that name the
option."""
from __future__ import annotations

import argparse

from .cost import CostError, CostModel


def _per_stage(text: str):
    """A number, or a comma list of numbers (one per stage), for a cost option."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or a comma list of numbers, one per stage (e.g. 1.5 or 1,2,1,2), got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


#: the command-line option of each :class:`~pipesched.cost.CostModel` field (errors name the option)
COST_FLAGS = {"forward": "--forward", "backward": "--backward", "input_grad": "--input-grad",
               "weight_grad": "--weight-grad", "recompute": "--recompute-cost", "latency": "--latency",
               "send_overhead": "--send-overhead",
               "bandwidth": "--bandwidth", "activation_bytes": "--activation-bytes", "stash_bytes": "--stash-bytes",
               "input_bytes": "--input-bytes", "recompute_bytes": "--recompute-bytes", "grad_bytes": "--grad-bytes",
               "tie_bytes": "--tie-bytes"}


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    """Cost-model options (seconds, bytes); a per-stage option takes one number or a comma list per stage. The
    costs ``zb-auto`` is built for (every command of :func:`schedule_parent`), and those simulate and render use."""
    group = parser.add_argument_group("cost model (seconds and bytes; per-stage values as a comma list; "
                                      "zb-auto is built for them)")
    group.add_argument("--forward", type=_per_stage, default=1.0, help="seconds per F (default 1)")
    group.add_argument("--backward", type=_per_stage, default=2.0, help="seconds per B (default 2)")
    group.add_argument("--input-grad", type=_per_stage, default=None,
                       help="seconds per I, for programs with a split backward (default B - W when --weight-grad is "
                            "given, else B/2)")
    group.add_argument("--weight-grad", type=_per_stage, default=None,
                       help="seconds per W, for programs with a split backward (default B - I when --input-grad is "
                            "given, else B/2)")
    group.add_argument("--recompute-cost", type=_per_stage, default=None, help="seconds per R (default F)")
    group.add_argument("--latency", type=float, default=0.0, help="seconds per message (default 0)")
    group.add_argument("--send-overhead", type=float, default=0.0,
                       help="seconds of the sending rank's time per SEND (LogP's o: gloo's send call; default 0)")
    group.add_argument("--bandwidth", type=float, default=float("inf"), help="bytes/s per link (default inf)")
    group.add_argument("--activation-bytes", type=_per_stage, default=0.0,
                       help="bytes of one microbatch's stage output (message size; default 0)")
    group.add_argument("--stash-bytes", type=_per_stage, default=None,
                       help="bytes held per in-flight microbatch for backward (default: activation bytes)")
    group.add_argument("--input-bytes", type=_per_stage, default=None,
                       help="with --recompute: bytes of a stage's input, kept per in-flight microbatch instead of the "
                            "stash (default: the previous stage's activation bytes, at most the stash bytes)")
    group.add_argument("--recompute-bytes", type=_per_stage, default=None,
                       help="with --recompute: bytes a stage holds for one microbatch after its R, input and re-saved "
                            "activations (default: the larger of stash and input bytes)")
    group.add_argument("--grad-bytes", type=_per_stage, default=0.0, help="bytes of a stage's gradients (all-reduce)")
    group.add_argument("--tie-bytes", type=_per_stage, default=0.0,
                       help="bytes of the tied gradients the TIE_REDUCE naming a stage sums (with --ties)")


def given_costs(args: argparse.Namespace) -> list[str]:
    """The cost options of ``args`` set to something other than their default, as ``--option value``."""
    return given_options(args, add_cost_args)


def given_options(args: argparse.Namespace, add_args, skip=()) -> list[str]:
    """The options ``add_args(parser)`` adds that ``args`` holds at other than their defaults, as typed: a flag
    alone (``--recompute``), ``--ranks 7``, a comma list (``--forward 1,2``), space-separated groups (``--ties
    0,3 1,2``); options whose dest is in ``skip`` are left out."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    defaults = vars(parser.parse_args([]))
    given = []
    for action in parser._actions:
        value = getattr(args, action.dest, defaults.get(action.dest))
        if not action.option_strings or action.dest in skip or value == defaults.get(action.dest):
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        given.append(flag if isinstance(value, bool) else f"{flag} {show_value(value)}")
    return given


def cost_from_args(args: argparse.Namespace) -> CostModel:
    """The :class:`CostModel` the cost options describe.

    Raises:
        ValueError: a bad cost, named by its command-line option.
    """
    try:
        return CostModel(
            forward=args.forward, backward=args.backward, input_grad=args.input_grad,
            weight_grad=args.weight_grad, recompute=args.recompute_cost, latency=args.latency,
            bandwidth=args.bandwidth, activation_bytes=args.activation_bytes, stash_bytes=args.stash_bytes,
            input_bytes=args.input_bytes, recompute_bytes=args.recompute_bytes, grad_bytes=args.grad_bytes,
            tie_bytes=args.tie_bytes, send_overhead=args.send_overhead,
        )
    except CostError as exc:
        raise named_cost_error(exc) from None


def named_cost_error(exc: CostError) -> ValueError:
    """``exc`` prefixed with the command-line option of the cost field it names (``--input-grad: cost ...``)."""
    return ValueError(f"{COST_FLAGS[exc.field]}: {exc}")



def show_value(value) -> str:
    """An option's value as typed: ``0.5``, ``1e+06``, ``7``, ``1,2``, or groups ``0,3 1,2``."""
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) for v in value):
            return " ".join(show_value(v) for v in value)
        return ",".join(show_value(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)
