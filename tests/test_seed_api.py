"""The seed's API (ExpertPredictorSet) against a reference written from the seed's model."""

import pytest
import torch

from tensorbend import ExpertPredictorSet
from tensorbend.errors import CheckpointError, PredictorInputError

L, D, E, P = 3, 12, 10, 16


class SeedLayer(torch.nn.Module):
    """One layer as the seed's ExpertPredictor builds it: fc1 -> bn -> GELU -> dropout -> fc2."""

    def __init__(self, din):
        super().__init__()
        self.fc1 = torch.nn.Linear(din, P)
        self.bn = torch.nn.BatchNorm1d(P)
        self.fc2 = torch.nn.Linear(P, E)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.bn(self.fc1(x))))


def _seed_modules(din=D + E):
    torch.manual_seed(0)
    ml = torch.nn.ModuleList([SeedLayer(din) for _ in range(L)])
    for m in ml:  # non-trivial running stats
        m.train()
        m(torch.randn(64, din) * 3 + 1)
    return ml.eval()


def _top(ml, layer, h, routing, n=5):
    x = torch.cat([h, routing])[None] if routing is not None else h[None]
    return ml[layer](x)[0].topk(n).indices.tolist()


def _multi_hot(ids):
    return torch.zeros(E).index_fill_(0, torch.tensor(ids, dtype=torch.long), 1.0)


@pytest.fixture
def seed_file(tmp_path):
    ml = _seed_modules()
    path = tmp_path / "predictor.pt"
    torch.save({"state_dict": ml.state_dict(), "num_layers": L, "trained": True}, path)
    return ml, path


def _pset(path=None, **kw):
    p = ExpertPredictorSet(num_layers=L, hidden_dim=D, num_experts=E, predictor_dim=P, **kw)
    if path is not None:
        p.load(path)
    return p


def test_the_seeds_checkpoint_loads_safely_and_predicts_alike(seed_file):
    ml, path = seed_file
    pset, h = _pset(path), torch.randn(D)
    with torch.no_grad():
        assert pset.predict(2, h, top_k=3, overprovision=2) == _top(ml, 2, h, torch.zeros(E))
        pset.update_routing([1, 4, 7])
        assert pset.predict(2, h, top_k=3, overprovision=2) == _top(ml, 2, h, _multi_hot([1, 4, 7]))
    assert pset.total_params == sum(q.numel() for q in ml.parameters())
    assert pset.size_mb == sum(q.numel() * 4 for q in ml.parameters()) / 1e6


def test_layer_zero_is_fed_the_stored_routing_and_reset_clears_it(seed_file):
    ml, path = seed_file
    pset, h = _pset(path), torch.randn(D)
    pset.update_routing([0, 5, 9])
    with torch.no_grad():
        assert pset.predict(0, h, top_k=3, overprovision=2) == _top(ml, 0, h, _multi_hot([0, 5, 9]))
        pset.reset_routing()
        assert pset.predict(0, h, top_k=3, overprovision=2) == _top(ml, 0, h, torch.zeros(E))


def test_out_of_range_ids_are_ignored(seed_file):
    ml, path = seed_file
    pset, h = _pset(path), torch.randn(D)
    pset.update_routing([-1, 3, E, E + 5])
    with torch.no_grad():
        assert pset.predict(1, h, top_k=3, overprovision=2) == _top(ml, 1, h, _multi_hot([3]))


def test_save_pt_is_the_seeds_format_and_round_trips(seed_file, tmp_path):
    ml, path = seed_file
    pset = _pset(path)
    pset.save(tmp_path / "x.pt")
    obj = torch.load(tmp_path / "x.pt", weights_only=True)
    assert set(obj) == {"state_dict", "num_layers", "trained"} and obj["num_layers"] == L
    assert obj["trained"] is True
    again = _seed_modules()
    for q in again.parameters():
        q.data.zero_()
    again.load_state_dict(obj["state_dict"])  # strict: the seed's own ModuleList keys
    for k, v in ml.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    back = _pset(tmp_path / "x.pt")
    for k, v in pset.net.state_dict().items():
        assert torch.equal(back.net.state_dict()[k], v), k


def test_save_safetensors_round_trips(seed_file, tmp_path):
    _, path = seed_file
    pset = _pset(path)
    pset.save(tmp_path / "x.safetensors")
    back = _pset(tmp_path / "x.safetensors")
    for k, v in pset.net.state_dict().items():
        assert torch.equal(back.net.state_dict()[k], v), k


def test_without_prev_routing_the_mlps_take_the_hidden_state_alone(tmp_path):
    ml = _seed_modules(din=D)
    path = tmp_path / "np.pt"
    torch.save({"state_dict": ml.state_dict(), "num_layers": L, "trained": True}, path)
    pset, h = _pset(path, use_prev_routing=False), torch.randn(D)
    pset.update_routing([1, 2])
    with torch.no_grad():
        assert pset.predict(1, h, top_k=3, overprovision=2) == _top(ml, 1, h, None)
    with pytest.raises(
        CheckpointError, match=r"fc1.weight expected shape \(16, 22\), found \(16, 12\)"
    ):
        _pset(path)


def test_wrong_inputs_raise_one_line_errors(seed_file, tmp_path):
    _, path = seed_file
    pset = _pset(path)
    for bad in (torch.randn(D + 1), torch.randn(2, D - 1), torch.randn(1, 2, D)):
        with pytest.raises(PredictorInputError, match=rf"expected shape \({D},\) or \(T, {D}\)"):
            pset.predict(0, bad)
    with pytest.raises(PredictorInputError, match=f"expected 0 <= layer_idx < {L}, found {L}"):
        pset.predict(L, torch.randn(D))
    assert len(pset.predict(0, torch.randn(4, D), top_k=2, overprovision=1)) == 4
    wrong = ExpertPredictorSet(num_layers=L, hidden_dim=D + 1, num_experts=E, predictor_dim=P)
    with pytest.raises(CheckpointError, match=r"fc1.weight expected shape \(16, 23\)"):
        wrong.load(path)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 32)
    with pytest.raises(CheckpointError, match="expected the seed's .pt"):
        pset.load(junk)
