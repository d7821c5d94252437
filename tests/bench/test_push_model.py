"""bench/push_model.py, the push past this machine on paper: pure arithmetic, held to the points it
was fitted on and to what the chain's design says (time flat in the hosts, linear in the bytes)."""

from bench.push_model import CHUNK, MEASURED, fit_efficiency, host_bytes, push_seconds


def test_the_fit_reproduces_every_measured_point_within_ten_percent():
    e = fit_efficiency(MEASURED)
    assert 0.5 < e <= 1.0
    for p in MEASURED:
        model = push_seconds(p.nbytes, p.link, p.hosts, e)
        assert abs(model / p.seconds - 1) < 0.10, p


def test_down_the_chain_a_push_grows_by_a_chunk_a_host_and_linearly_in_the_bytes():
    one, many = push_seconds(16e9, 12.5, 1, 0.9), push_seconds(16e9, 12.5, 33, 0.9)
    assert abs((many - one) - 32 * CHUNK / (0.9 * 12.5e9)) < 1e-9  # 32 more hops, a chunk each
    assert abs(push_seconds(32e9, 12.5, 1, 0.9, t0=0) - 2 * push_seconds(16e9, 12.5, 1, 0.9, t0=0)) < 1e-9
    assert host_bytes(16e9, processes=0) == 32e9  # the served weights and the kept staging buffer
