"""Chrome trace / Perfetto JSON export of a timeline: one process track per rank, one event per instruction.

Open the file in https://ui.perfetto.dev or chrome://tracing. No matplotlib needed.
"""
from __future__ import annotations

import json

from ..checks import check_path, check_timeline
from ..ir import COMPUTE_OPS, RECV_OPS, SEND_OPS, Op
from ..timeline import Timeline

_CATEGORY = {Op.ALL_REDUCE: "all-reduce", Op.TIE_REDUCE: "tie-reduce"}
_LANE_NAMES = {"compute": "compute + sends", "recv": "recv (posted → landed)", "all-reduce": "all-reduce"}


def to_chrome_trace(timeline: Timeline) -> dict:
    """The timeline as a Chrome Trace Event Format dict (JSON-ready).

    Layout: rank ``r`` is process ``pid = r`` named ``"rank r"`` (sorted by rank). Within it, thread 0
    holds the compute instructions and the zero-length SENDs; RECV spans (posted to landed) and
    ALL_REDUCE spans, which overlap compute, go to extra threads ("lanes", ``tid >= 1``) chosen so that
    no two events of a thread overlap. Every instruction is exactly one complete event (``"ph": "X"``)
    with ``ts``/``dur`` in microseconds from the step start, ``name`` its text form (``F0.3``), ``cat``
    one of compute/send/recv/all-reduce and ``args`` its op, stage, microbatch, peer and rank. The
    instruction events come after the metadata events, ordered by (rank, start, end) — the timeline's
    order. Labels (schedule, sizes, costs, source, bubble) go to ``otherData``.

    Raises:
        TypeError: ``timeline`` is not a :class:`~pipesched.timeline.Timeline`.
        ValueError: an event's rank is outside ``[0, num_ranks)``.
    """
    check_timeline(timeline, where="to_chrome_trace: ")
    lanes = _assign_lanes(timeline)
    meta_events, events = [], []
    for rank in range(timeline.num_ranks):
        meta_events.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        meta_events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
    named = set()
    for index, event in enumerate(timeline.events):
        if not 0 <= event.rank < timeline.num_ranks:
            raise ValueError(f"event {event.instr} has rank {event.rank}, outside [0, {timeline.num_ranks})")
        kind, tid = lanes[index]
        if (event.rank, tid) not in named:
            named.add((event.rank, tid))
            label = _LANE_NAMES[kind] + (f" {tid}" if kind != "compute" else "")
            meta_events.append(_meta("thread_name", event.rank, tid, {"name": label}))
            meta_events.append(_meta("thread_sort_index", event.rank, tid, {"sort_index": tid}))
        instr = event.instr
        events.append({
            "name": str(instr), "cat": _category(instr.op), "ph": "X", "pid": event.rank, "tid": tid,
            "ts": event.start * 1e6, "dur": max(0.0, event.duration) * 1e6,
            "args": {"op": instr.op.value, "stage": instr.stage, "microbatch": instr.microbatch,
                     "peer": instr.peer, "rank": event.rank},
        })
    other = {"source": timeline.source, "num_ranks": timeline.num_ranks, "makespan_s": timeline.makespan,
             "bubble_fraction": timeline.bubble_fraction, **{str(k): v for k, v in timeline.meta.items()}}
    return {"traceEvents": meta_events + events, "displayTimeUnit": "ms", "otherData": _jsonable(other)}


def save_chrome_trace(timeline: Timeline, path) -> None:
    """Write :func:`to_chrome_trace` of ``timeline`` to ``path`` as JSON.

    Raises:
        OSError: the file cannot be written. TypeError: ``timeline`` is not a :class:`~pipesched.timeline.Timeline`
            (checked before the file is opened), or ``path`` not a str or os.PathLike (an int would be taken for a
            file descriptor).
    """
    check_timeline(timeline, where="save_chrome_trace: ")  # before open(): no empty file left behind
    check_path(path, where="save_chrome_trace: ")  # an int would be taken for a file descriptor
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(to_chrome_trace(timeline), handle)


write_chrome_trace = save_chrome_trace  # an older name, kept for scripts that use it


def _category(op: Op) -> str:
    if op in COMPUTE_OPS:
        return "compute"
    if op in SEND_OPS:
        return "send"
    if op in RECV_OPS:
        return "recv"
    return _CATEGORY[op]


def _assign_lanes(timeline: Timeline) -> list[tuple[str, int]]:
    """Per event (timeline order): its lane kind and thread id; overlapping spans get separate threads."""
    lane_end: dict = {}  # (rank, kind) -> [end time of each lane]
    first_tid: dict = {}
    result = []
    for event in timeline.events:
        op = event.instr.op
        if op in COMPUTE_OPS or op in SEND_OPS:
            result.append(("compute", 0))
            continue
        kind = "recv" if op in RECV_OPS else "all-reduce"
        ends = lane_end.setdefault((event.rank, kind), [])
        slot = next((i for i, end in enumerate(ends) if end <= event.start), None)
        if slot is None:
            slot = len(ends)
            ends.append(event.end)
        else:
            ends[slot] = event.end
        result.append((kind, slot))
    # number the lanes of each rank: recv lanes first, then all-reduce lanes
    for rank in range(timeline.num_ranks):
        recv = len(lane_end.get((rank, "recv"), ()))
        first_tid[(rank, "recv")] = 1
        first_tid[(rank, "all-reduce")] = 1 + recv
    return [(kind, 0 if kind == "compute" else first_tid[(event.rank, kind)] + slot)
            for (kind, slot), event in zip(result, timeline.events)]


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
