"""Large pictures: from PATCH_LIMIT compute boxes on, draw_rows draws the boxes as collections (one per style),
showing exactly the boxes (places, colours, edges, hatches, z-order) the per-box patches would."""
import io
import re

import numpy as np
import pytest
from matplotlib.colors import to_hex

from pipesched import CostModel, compile_program, simulate
from pipesched.ir import COMPUTE_OPS
from pipesched.viz import gantt
from pipesched.viz.cli import main
from pipesched.viz.compare import plot_comparison
from pipesched.viz.gantt import PATCH_LIMIT, draw_rows, new_figure, plot_timeline

KINDS = ("compute", "wait", "allreduce")


def big(name, p, m, **kwargs):
    """A timeline above PATCH_LIMIT, with p2p waits (latency) and all-reduces (dp=2)."""
    timeline = simulate(compile_program(name, p, m, dp_size=2, **kwargs), CostModel(latency=0.25))
    assert sum(e.instr.op in COMPUTE_OPS for e in timeline.events) >= PATCH_LIMIT
    return timeline


def rgba(value, index=0):
    value = np.asarray(value, dtype=float)
    return tuple(value[index % len(value)] if value.ndim == 2 else value)


def corners(vertices):
    v = np.asarray(vertices, dtype=float)[:4]
    return tuple(float(c) for c in (*v.min(axis=0), *v.max(axis=0)))  # x0, y0, x1, y1


def patch_boxes(ax, tag=""):
    """{kind: sorted [(x0, y0, x1, y1, face, edge, line width, zorder, hatch, hatch colour)]} of the per-box
    patches (gid "{tag}{kind}:..."); the hatch colour only where there is a hatch."""
    found = {kind: [] for kind in KINDS}
    for patch in ax.patches:
        kind = (patch.get_gid() or "")[len(tag):].split(":")[0]
        if kind in found:
            box = corners(patch.get_patch_transform().transform(patch.get_path().vertices))
            hatch = patch.get_hatch() or ""
            found[kind].append(box + (rgba(patch.get_facecolor()), rgba(patch.get_edgecolor()),
                                      float(patch.get_linewidth()), patch.get_zorder(), hatch,
                                      rgba(patch.get_hatchcolor()) if hatch else None))
    return {kind: sorted(boxes) for kind, boxes in found.items()}


def collection_boxes(ax, tag=""):
    """The same from the collections: "{tag}{kind}-boxes:{i}" (fill and edge, one path per box) and the
    "{tag}{kind}-hatch:{i}.{j}" drawn over them (one path of all boxes with that hatch, hatch only)."""
    filled = {kind: [] for kind in KINDS}
    hatches = {}  # (kind, corners) -> (hatch, hatch colour)
    for collection in ax.collections:
        match = re.fullmatch(re.escape(tag) + r"(\w+)-(boxes|hatch):[\d.]+", collection.get_gid() or "")
        assert match, collection.get_gid()
        kind, part = match.groups()
        if part == "hatch":
            (path,) = collection.get_paths()
            assert not np.asarray(collection.get_facecolor()).reshape(-1, 4)[:, 3].any()  # no fill
            assert not np.asarray(collection.get_edgecolor()).reshape(-1, 4)[:, 3].any()  # no visible edge
            assert collection.get_snap() is True
            for poly in path.vertices.reshape(-1, 5, 2):
                key = (kind, corners(poly))
                assert key not in hatches  # one hatch per box
                hatches[key] = (collection.get_hatch(), rgba(collection.get_hatchcolor()),
                                float(collection.get_linewidth()[0]), collection.get_zorder())
            continue
        assert not collection.get_hatch()
        for i, path in enumerate(collection.get_paths()):
            filled[kind].append((corners(path.vertices), rgba(collection.get_facecolor(), i),
                                 rgba(collection.get_edgecolor(), i),
                                 float(np.atleast_1d(collection.get_linewidth())[i % len(collection.get_linewidth())]),
                                 collection.get_zorder()))
    found = {kind: [] for kind in KINDS}
    for kind, boxes in filled.items():
        for box, face, edge, width, zorder in boxes:
            hatch, colour, hatch_width, hatch_zorder = hatches.pop((kind, box), ("", None, width, zorder))
            assert (hatch_width, hatch_zorder) == (width, zorder)  # snapped as the boxes, drawn with them
            found[kind].append(box + (face, edge, width, zorder, hatch, colour))
    assert not hatches  # every hatched path is a box
    return {kind: sorted(boxes) for kind, boxes in found.items()}


def texts(ax):
    return sorted((t.get_position(), t.get_text(), t.get_color()) for t in ax.texts)


@pytest.mark.parametrize("name,p,m,kwargs", [
    ("zbv", 4, 96, {}),  # F, I, W on two hatched/lighter virtual stages: 6 * 96 * 4 = 2304 boxes
    ("1f1b", 8, 128, {"recompute": True}),  # F, B, R: 3 * 128 * 8 = 3072 boxes
])
def test_collections_draw_the_boxes_the_patches_would(name, p, m, kwargs):
    timeline = big(name, p, m, **kwargs)
    fig_c, ax_c = new_figure(timeline, p)
    fig_p, ax_p = new_figure(timeline, p)
    drawn = draw_rows(ax_c, timeline)  # above the limit: collections
    assert draw_rows(ax_p, timeline, per_box=True) == drawn
    assert not [a for a in ax_c.patches if (a.get_gid() or "").split(":")[0] in KINDS]  # only idle bands
    assert sorted(a.get_gid() for a in ax_c.patches) == sorted(f"idle:{r}" for r in range(p))
    from_patches, from_collections = patch_boxes(ax_p), collection_boxes(ax_c)
    assert len(from_patches["compute"]) == drawn == sum(e.instr.op in COMPUTE_OPS for e in timeline.events)
    assert from_patches["wait"] and from_patches["allreduce"]  # the case has all three kinds
    for kind in KINDS:
        assert from_collections[kind] == from_patches[kind], kind
    hatches = {box[8] for box in from_collections["compute"]}
    assert hatches == ({"", "////"} if name == "zbv" else {""})
    assert texts(ax_c) == texts(ax_p)  # microbatch numbers where they fit, as before
    assert ax_c.get_xlim() == ax_p.get_xlim() and ax_c.get_ylim() == ax_p.get_ylim()


@pytest.mark.parametrize("name,p,m,most,share", [
    ("1f1b", 8, 128, 2, 0.001),  # no hatch, boxes drawn in the same order: the same picture up to rounding
    # hatched chunk-1 boxes: their hatch is drawn after all fills and edges (a patch draws its hatch under its
    # own edge, before the next box): antialiased pixels at box edges differ a little (2.3% of them, by <= 25)
    ("zbv", 4, 96, 32, 0.03),
])
def test_collections_and_patches_give_the_same_pixels(name, p, m, most, share):
    timeline = big(name, p, m)
    pixels = []
    for per_box in (False, True):
        fig, ax = new_figure(timeline, p)
        draw_rows(ax, timeline, per_box=per_box)
        fig.canvas.draw()
        pixels.append(np.asarray(fig.canvas.buffer_rgba(), dtype=int))
    differ = np.abs(pixels[0] - pixels[1]).max(axis=2)
    assert differ.max() <= most and (differ > 0).mean() < share


def test_the_limit_is_a_number_of_compute_boxes(monkeypatch):
    timeline = simulate(compile_program("1f1b", 2, 3), CostModel())  # 12 boxes
    for limit, patches in ((12, False), (13, True)):
        monkeypatch.setattr(gantt, "PATCH_LIMIT", limit)
        ax = plot_timeline(timeline).axes[0]
        gids = [a.get_gid() or "" for a in ax.patches]
        assert sum(g.startswith("compute:") for g in gids) == (12 if patches else 0)
        assert [len(c.get_paths()) for c in ax.collections] == ([] if patches else [12])
        if not patches:  # one collection, a face colour per box: forward blue, backward vermillion
            faces = {to_hex(face) for face in ax.collections[0].get_facecolor()}
            assert faces == {"#0072b2", "#d55e00"} and ax.collections[0].get_gid() == "compute-boxes:0"


def test_comparison_panels_use_collections_too():
    timeline = big("1f1b", 8, 128)
    measured = simulate(compile_program("1f1b", 8, 128, dp_size=2), CostModel(latency=0.3))
    for mode in ("side-by-side", "overlay"):
        fig = plot_comparison(timeline, measured, mode=mode)
        gids = [c.get_gid() for ax in fig.axes for c in ax.collections if c.get_gid()]
        for tag in ("predicted:", "measured:"):
            assert any(g.startswith(tag + "compute-boxes:") for g in gids), (mode, tag)
            assert sum(len(c.get_paths()) for ax in fig.axes for c in ax.collections
                       if (c.get_gid() or "").startswith(tag + "compute-boxes:")) == 2 * 128 * 8
        assert not any((a.get_gid() or "").split(":")[1:2] == ["compute"] for ax in fig.axes for a in ax.patches)


def test_render_says_it_draws_collections(tmp_path, capsys):
    out = tmp_path / "big.png"
    assert main(["render", "1f1b", "-p", "8", "-m", "128", "-o", str(out)]) == 0
    assert "rendering 2048 boxes on 8 ranks..." in capsys.readouterr().err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["render", "1f1b", "-p", "8", "-m", "124", "-o", str(out)]) == 0
    assert "rendering" not in capsys.readouterr().err  # 1984 boxes: patches, no line


def test_svg_of_a_large_picture_is_written(tmp_path):
    buffer = io.StringIO()
    plot_timeline(big("zbv", 4, 96)).savefig(buffer, format="svg")
    assert buffer.getvalue().count("<path") > 2304
