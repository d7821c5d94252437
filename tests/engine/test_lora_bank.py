"""engine.lora_bank: each row gets its own sequence's adapter, as PEFT's unmerged forward computes it."""

from types import SimpleNamespace

import pytest
import torch

from engine.lora_bank import LoraBank


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6)).eval()


def _factors(seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return {"0": (torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g), scale)}


def _peft(base_out, x, factors):
    a, b, s = factors["0"]
    return base_out + (x @ a.T @ b.T) * s  # PEFT LoraLayer.forward: base(x) + lora_B(lora_A(x)) * scaling


def test_rows_of_two_versions_in_one_step():
    model = _model()
    bank = LoraBank(model, max_versions=4)
    one, two = _factors(1), _factors(2)
    bank.add(1, one)
    old = SimpleNamespace(lora_version=None)
    assert bank.assign([old], [3]) == [1]  # a sequence with no version takes the newest
    bank.end_step()
    bank.add(2, two)
    new = SimpleNamespace(lora_version=None)
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        assert bank.assign([old, new], [3, 2]) == [1, 2]
        out = model(x)
        bank.end_step()
        base = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
        # PEFT's arithmetic per row; a matmul over 3 rows may round unlike one over 5 in the last
        # bit of each of its 8 + 2 products' sums: 1e-5 is ~10 ulps at these magnitudes (|out| < 10)
        assert torch.allclose(out[0, :3], _peft(base, x, one)[0, :3], rtol=0, atol=1e-5)
        assert torch.allclose(out[0, 3:], _peft(base, x, two)[0, 3:], rtol=0, atol=1e-5)
        assert not torch.allclose(out[0, 3:], _peft(base, x, one)[0, 3:], rtol=0, atol=1e-2)
        assert torch.equal(model(x), base)  # outside a step (end_step): the base


def test_the_oldest_version_goes_and_its_sequences_move_to_the_newest():
    model = _model()
    bank = LoraBank(model, max_versions=2)
    seq = SimpleNamespace(lora_version=None)
    bank.add(1, _factors(1))
    bank.assign([seq], [1])
    bank.add(2, _factors(2))
    bank.add(3, _factors(3))
    assert list(bank.versions) == [2, 3]
    assert bank.assign([seq], [1]) == [3]
    bank.clear()
    assert not bank.active and bank.assign([seq], [1]) is None
    assert not model[0]._forward_hooks  # no adapter: no hook left on the layer
    with pytest.raises(ValueError):
        LoraBank(model, 0)
