"""The small top-k kernel (kalos.index.kernels.topk_small) on the CPU, under
TRITON_INTERPRET=1: the values and positions of torch.topk, over one stage and several."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import pytest

from kalos.index.kernels.topk_small import GROUP, MAX_K, topk_small


@pytest.mark.parametrize(
    ("b", "w", "k"),
    [(1, 10, 3), (2, GROUP, 1), (1, GROUP + 1, 10), (3, 5000, 7), (1, 4 * GROUP, MAX_K),
     (1, 200_000, 10)],  # 200K: three stages
)  # fmt: skip
def test_equals_torch_topk_on_distinct_values(b, w, k):
    x = torch.randn(b, w, generator=torch.Generator().manual_seed(w + k))
    want = torch.topk(x, k, dim=1)
    vals, pos = topk_small(x, k)
    torch.testing.assert_close(vals, want.values)
    torch.testing.assert_close(pos, want.indices)


def test_minus_infinity_fills_the_tail_and_ties_go_to_the_lower_position():
    x = torch.full((1, 3000), float("-inf"))
    x[0, [5, 2500, 17]] = torch.tensor([1.0, 2.0, 1.0])
    vals, pos = topk_small(x, 5)
    assert vals[0, :3].tolist() == [2.0, 1.0, 1.0]
    assert pos[0, :3].tolist() == [2500, 5, 17]
    assert torch.isinf(vals[0, 3:]).all() and ((pos >= 0) & (pos < 3000)).all()


def test_bad_k():
    with pytest.raises(ValueError):
        topk_small(torch.zeros(1, 100), MAX_K + 1)
    with pytest.raises(ValueError):
        topk_small(torch.zeros(1, 4), 5)
