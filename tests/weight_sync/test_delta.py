"""weight_sync.common.delta: a delta applied on its base gives the new tensor bit for bit, in the
smallest encoding, and a delta that does not fit its tensor changes nothing and says why."""

import pytest
import torch

from weight_sync.common.delta import Delta, apply, changed_positions, encode, encoded_bytes, pack_bits, unpack_bits


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.reshape(-1).view(width), b.reshape(-1).view(width))


def _changed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    flat = new.view(-1)
    k = int(flat.numel() * fraction)
    pos = torch.randperm(flat.numel(), generator=g)[:k]
    flat[pos] = torch.randn(k, generator=g).to(base.dtype)
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction,kind", [(0.0, "indices"), (0.01, "indices"), (0.2, "bitmap"), (0.99, "full")])
def test_a_delta_applied_on_its_base_gives_the_new_tensor_bit_for_bit(dtype, fraction, kind):
    base = torch.randn(37, 113, generator=torch.Generator().manual_seed(1)).to(dtype)
    new = _changed(base, fraction, seed=2)
    d = encode(base, new)
    assert d.kind == kind
    out = base.clone()
    apply(out, d)
    assert _bits_equal(out, new)
    k = changed_positions(base, new).numel()
    assert d.nbytes == encoded_bytes(new.numel(), k, new.element_size())[kind]


def test_bits_not_values_decide_what_changed():
    """-0.0 vs 0.0 and a NaN's payload are changes (a full push would send them); equal NaN bits are not."""
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0
    assert changed_positions(base, new).tolist() == [0]
    nan2 = base.clone().view(torch.int16)
    nan2[2] += 1  # another NaN
    assert changed_positions(base, nan2.view(torch.bfloat16)).tolist() == [2]
    out = base.clone()
    apply(out, encode(base, new))
    assert _bits_equal(out, new)


def test_indices_win_below_one_thirty_second_changed_the_bitmap_above():
    n = 32_000
    assert encoded_bytes(n, 999, 2)["indices"] < encoded_bytes(n, 999, 2)["bitmap"]
    assert encoded_bytes(n, 1001, 2)["indices"] > encoded_bytes(n, 1001, 2)["bitmap"]
    assert encoded_bytes(n, 1000, 2) == {"indices": 6000, "bitmap": 6000, "full": 64000}


def test_bits_pack_and_unpack():
    mask = torch.rand(1001, generator=torch.Generator().manual_seed(3)) < 0.3
    packed = pack_bits(mask)
    assert packed.numel() == 126 and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 1001), mask)
    assert pack_bits(torch.tensor([True, False, True])).tolist() == [5]  # least significant bit first


@pytest.mark.parametrize("bad,why", [
    (Delta("indices", torch.tensor([0, 50], dtype=torch.int32), torch.zeros(2, dtype=torch.bfloat16)), "outside"),
    (Delta("indices", torch.tensor([0, 1], dtype=torch.int32), torch.zeros(3, dtype=torch.bfloat16)), "positions for"),
    (Delta("bitmap", torch.zeros(2, dtype=torch.uint8), torch.zeros(0, dtype=torch.bfloat16)), "bitmap of 2 bytes"),
    (Delta("full", torch.empty(0, dtype=torch.uint8), torch.zeros(9, dtype=torch.bfloat16)), "full delta of 9"),
    (Delta("indices", torch.tensor([0], dtype=torch.int32), torch.zeros(1, dtype=torch.float32)), "values are"),
    (Delta("runs", torch.empty(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.bfloat16)), "unknown delta kind"),
])
def test_a_delta_that_does_not_fit_its_tensor_changes_nothing(bad, why):
    base = torch.arange(40, dtype=torch.bfloat16)
    before = base.clone()
    with pytest.raises(ValueError, match=why):
        apply(base, bad)
    assert _bits_equal(base, before)


def test_a_delta_needs_the_shape_and_dtype_of_its_base():
    with pytest.raises(ValueError, match="same shape and dtype"):
        encode(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="same shape and dtype"):
        encode(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.035, 0.3, 1.0])
def test_the_one_pass_kernels_give_torchs_delta_bit_for_bit(monkeypatch, fraction):
    """engine/kernels/native/delta_bits.c against the torch path it replaces for 2-byte values (a length
    that is no multiple of the vector's 32, -0.0 and a NaN among the changes)."""
    from weight_sync.common import delta as D

    if D._native() is None:
        pytest.skip("no C compiler for the native kernels")
    base = torch.randn(4099, generator=torch.Generator().manual_seed(5)).bfloat16()
    new = _changed(base, fraction, seed=6)
    new[1], new[2] = -0.0 if base[1] == 0 else new[1], float("nan")
    native = encode(base, new)
    monkeypatch.setattr(D, "_native", lambda: None)
    torch_way = encode(base, new)
    assert native.kind == torch_way.kind and torch.equal(native.positions, torch_way.positions)
    assert _bits_equal(native.values, torch_way.values)
    monkeypatch.undo()
    out = base.clone()
    apply(out, native)
    assert _bits_equal(out, new)


def test_a_bitmap_with_more_bits_than_values_changes_nothing():
    base = torch.arange(40, dtype=torch.bfloat16)
    before = base.clone()
    bits = torch.zeros(5, dtype=torch.uint8)
    bits[0] = 0b111  # three positions, two values
    with pytest.raises(ValueError, match="3 positions for 2 values"):
        apply(base, Delta("bitmap", bits, torch.ones(2, dtype=torch.bfloat16)))
    assert _bits_equal(base, before)
