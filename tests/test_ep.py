"""Expert-parallel pre-staging statistics on a hand-counted example."""

import pytest
import torch

from tensorbend.errors import TensorbendError
from tensorbend.simulate.ep import EPConfig, ep_stats, rank_of


def test_hand_counted_dispatch_counts():
    # E=4 experts on R=2 ranks (contiguous: experts 0,1 -> rank 0; 2,3 -> rank 1), one layer.
    # step 0: truth t0 {0,1} t1 {2,3} t2 {0,2}  -> rank 0 receives 2 tokens, rank 1 receives 2
    #         pred  t0 {0,1} t1 {0,3} t2 {1,3}  -> predicted 3 and 2
    # step 1: truth t3 {1,2} -> 1 and 1; pred {1,0} -> 1 and 0
    truth = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 2]])[:, None]
    pred = torch.tensor([[0, 1], [0, 3], [1, 3], [1, 0]])[:, None]
    s = ep_stats(truth, pred, torch.tensor([0, 0, 0, 1]), 4, EPConfig(degree=2))
    assert s["steps"] == 2 and s["layers"] == 1
    assert s["mae_tokens"] == 0.5  # |3-2| + |2-2| + |1-1| + |0-1| over 4
    assert s["all_ranks_predicted_share"] == 0.75  # t3 also goes to rank 1, not predicted
    assert s["buffer_p99_static"] == 2.0  # actual counts 2, 2, 1, 1
    # margin = 99th percentile of actual - predicted (-1, 0, 0, 1), linearly interpolated: 0.97
    assert s["margin_tokens"] == pytest.approx(0.97)
    assert s["buffer_p99_predicted_mean"] == pytest.approx(1.5 + 0.97)


def test_placements_and_perfect_prediction():
    assert rank_of(6, EPConfig(3)).tolist() == [0, 0, 1, 1, 2, 2]
    assert rank_of(6, EPConfig(3, "round_robin")).tolist() == [0, 1, 2, 0, 1, 2]
    g = torch.Generator().manual_seed(0)
    truth = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(64)]).view(64, 1, 4)
    s = ep_stats(truth, truth.flip(-1), torch.arange(64) // 8, 16, EPConfig(4))
    assert s["mae_tokens"] == 0.0 and s["all_ranks_predicted_share"] == 1.0
    assert s["margin_tokens"] == 0.0
    # a layer without a prediction (valid False) is left out
    s = ep_stats(
        truth.expand(64, 2, 4),
        truth.expand(64, 2, 4),
        torch.zeros(64),
        16,
        EPConfig(4),
        valid_L=torch.tensor([False, True]),
    )
    assert s["layers"] == 1


def test_bad_degree_is_refused():
    with pytest.raises(TensorbendError, match="ep-degree"):
        EPConfig(0)
