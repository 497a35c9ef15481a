"""Pipeline(num_microbatches=np.int64(2), dp_size=np.int64(1)) builds and steps like plain ints, its program
holding plain ints; a bool is refused naming the argument. One rank in this process (see test_single_process)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from pipesched.runtime import Pipeline

from rt_cases import mlp

np = pytest.importorskip("numpy")


def test_numpy_sizes_build_the_int_pipeline(no_launcher):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SingleProcessWarning: one rank
        pipe = Pipeline(mlp(num_layers=4), schedule="interleaved-1f1b", num_microbatches=np.int64(2),
                        virtual_stages=np.int64(2), dp_size=np.int64(1), loss_fn=F.mse_loss)
    assert type(pipe.program.num_microbatches) is int and type(pipe.program.dp_size) is int
    assert (pipe.program.num_microbatches, pipe.program.num_stages) == (2, 2)
    g = torch.Generator().manual_seed(0)
    loss = pipe.step(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
    assert loss.shape == () and torch.isfinite(loss)
    pipe.close()


@pytest.mark.parametrize("argument", ["num_microbatches", "dp_size"])
def test_a_bool_is_refused(no_launcher, argument):
    kwargs = {"num_microbatches": 2, "dp_size": 1, argument: True}
    with pytest.raises(ValueError, match=f"{argument} must be an integer >= 1, got True \\(a bool is not a count\\)"):
        Pipeline(mlp(num_layers=4), schedule="1f1b", loss_fn=F.mse_loss, **kwargs)
