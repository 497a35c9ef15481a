"""Sparse gradients (nn.Embedding(sparse=True)) through the data-parallel all-reduce (pp=2 x dp=2: the average
over replicas of the unsplit model's gradient, bitwise, still sparse), through the tied-gradient sum of a sparse
embedding tied to a dense LM head (pp=2 x dp=2 and pp=4: dense, as the unsplit model's accumulation of a sparse
and a dense gradient; to rounding, the uses summed in another order), and clip_grad_norm_ of a sparse gradient
(against torch's clip_grad_norm_ of the same gradients made dense), over two SGD steps. 4 spawned gloo ranks."""
import pytest

from pipesched.runtime import launch

import rt_sparse_grads

pytestmark = pytest.mark.multiprocess

#: the tolerance where the pipeline sums the same terms in another order (tied uses; the norm over ranks)
RTOL = 1e-5
FIRST = ["0.weight", "1.bias", "1.weight"]  # pipeline rank 0 of pp=2: Embedding, Linear
LAST = ["3.bias", "3.weight"]


@pytest.fixture(scope="module")
def results():
    return launch(rt_sparse_grads.suite, rt_sparse_grads.WORLD, timeout=240)


def test_data_parallel_average_of_sparse_gradients_is_bitwise_and_stays_sparse(results):
    for rank, res in enumerate(results):
        first = rank % 2 == 0
        for row in res["dp"]:
            assert row["names"] == (FIRST if first else LAST), (rank, row)
            assert row["sparse"] == (["0.weight"] if first else []), (rank, row)
            assert row["bitwise"] is True and row["worst"] == 0.0, (rank, row)


@pytest.mark.parametrize("key", ["tied-dp", "tied-pp4"])
def test_a_sparse_embedding_tied_to_a_dense_head_gets_the_dense_sum(results, key):
    names = {"tied-dp": [FIRST, ["0.weight"], FIRST, ["0.weight"]],
             "tied-pp4": [["0.weight"], ["1.bias", "1.weight"], [], ["0.weight"]]}[key]
    for rank, res in enumerate(results):
        for row in res[key]:
            assert row["names"] == names[rank], (rank, row)
            assert row["sparse"] == [], (rank, row)  # sparse + dense accumulate dense, as in the unsplit model
            assert row["worst"] <= RTOL, (rank, row)


def test_clip_grad_norm_counts_sparse_gradients(results):
    for rank, res in enumerate(results):
        first = rank % 2 == 0
        for step, row in enumerate(res["clip-dp"]):
            assert row["bitwise"] is True, (rank, step, row)
            assert row["clip_rel"] <= 1e-6, (rank, step, row)
            assert row["clipped"]["worst"] <= RTOL, (rank, step, row)
            assert row["clipped"]["sparse"] == (["0.weight"] if first else []), (rank, step, row)
        assert res["clip-dp"][0]["clip_rel"] == 0.0 and res["clip-dp"][0]["clipped"]["bitwise"] is True
