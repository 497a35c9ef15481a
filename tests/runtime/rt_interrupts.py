"""Workers of test_interrupts.py: a layer on pipeline rank 1 raises KeyboardInterrupt (Ctrl-C) or SystemExit
(sys.exit) in the second step."""
import torch
import torch.nn.functional as F
from torch import nn

from pipesched.runtime import Pipeline, PipelineError


class Interrupt(nn.Module):
    """Passes its input on; raises ``kind`` at its ``at``-th call (counted over the job's forwards)."""

    def __init__(self, kind: str, at: int) -> None:
        super().__init__()
        self.kind, self.at, self.calls = kind, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt() if self.kind == "KeyboardInterrupt" else SystemExit(3)
        return x


def _outcome(call) -> str:
    try:
        call()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except SystemExit as exc:
        return f"SystemExit {exc.code}"
    except PipelineError as exc:
        return f"PipelineError: {exc}"
    return "returned"


def interrupted(rank, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Interrupt(kind, at=3), nn.Linear(4, 4))
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, balance=[2, 2], timeout=30)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    first = _outcome(lambda: pipe.step(x, y))  # two microbatches: calls 1 and 2
    second = _outcome(lambda: pipe.step(x, y))  # raises at the first microbatch's F on rank 1
    third = _outcome(lambda: pipe.step(x, y))
    return first, second, third
