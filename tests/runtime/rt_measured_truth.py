"""Ranks for test_measured_truth.py: a step, a second step and a forward() per schedule, then every timeline."""
import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import mlp

CASES = (("1f1b", 1, 4), ("dualpipev", 2, 4))


def timelines(rank):
    out = {}
    for schedule, v, m in CASES:
        pipe = Pipeline(mlp(num_layers=8, width=16), schedule=schedule, num_microbatches=m, virtual_stages=v,
                        loss_fn=F.mse_loss)
        torch.manual_seed(1)
        x, y = torch.randn(4 * m, 16), torch.randn(4 * m, 16)
        for _ in range(2):
            pipe.step(x, target=y)
        pipe.forward(x)
        out[schedule] = {"gathered": pipe.gather_timeline().to_json_dict(),
                         "gathered_forward": pipe.gather_timeline(kind="forward").to_json_dict(),
                         "local": pipe.timeline().to_json_dict(),
                         "local_forward": pipe.timeline(kind="forward").to_json_dict(),
                         "program": str(pipe.program)}
        pipe.close()
    return out
