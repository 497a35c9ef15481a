"""A layer's own saved_tensors_hooks (pack keeps ``t.detach()``) leave nothing alive after a step, under the
schedules that keep a graph across instructions (split backward: I and W) or drop one (recompute: F's). The hunt
found a pack that keeps ``t`` itself leaks a step's saved tensors every step there (a reference cycle through the
output's ``grad_fn``, as in torch wherever a graph is kept with ``retain_graph=True`` or dropped without a
backward); the README asks for ``t.detach()``, and this checks that that leaves nothing."""
import rt_saved_hooks
from pipesched.runtime import launch

CONFIGS = [dict(schedule="1f1b"), dict(schedule="1f1b", recompute=True), dict(schedule="1f1b", split_backward=True),
           dict(schedule="zb-h1"), dict(schedule="zbv", recompute=True)]


def test_a_detaching_pack_hook_leaves_no_saved_tensor_alive_after_a_step():
    for rank, per_config in enumerate(launch(rt_saved_hooks.live_after_steps, 2, CONFIGS, timeout=240)):
        assert per_config == [(True, [0, 0, 0])] * len(CONFIGS), (rank, per_config)
