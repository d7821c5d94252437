"""bench/push_stall.py's arithmetic: the 'felt' sum taken where no push was (the stream's own noise,
the floor a push's figure is read against)."""

from bench.push_stall import felt_without_pushes


def test_a_steady_stream_feels_nothing_and_a_slow_stretch_is_counted_once():
    times = [0.1 * i for i in range(40)]  # gaps of 0.1 s
    assert all(abs(f) < 1e-9 for f in felt_without_pushes(times, [], after=2, start=0.0))
    slow = times[:20] + [t + 0.3 for t in times[20:]]  # one gap 0.3 s long, between 1.9 and 2.3
    felts = felt_without_pushes(slow, [], after=2, start=0.0)
    assert sum(abs(f - 0.3) < 1e-9 for f in felts) == 1  # windows do not overlap: one of them holds it
    assert all(abs(f) < 1e-9 or abs(f - 0.3) < 1e-9 for f in felts)


def test_windows_skip_the_pushes_and_the_ramp_up():
    times = [0.1 * i for i in range(60)]
    times = times[:30] + [t + 1.0 for t in times[30:]]  # a push's stall at 2.9 -> 3.9
    felts = felt_without_pushes(times, [(2.5, 4.5)], after=2, start=0.0)
    assert felts and all(abs(f) < 1e-9 for f in felts)  # the stall lies inside the push's window
    late = felt_without_pushes(times, [(2.5, 4.5)], after=2, start=4.6)
    assert 0 < len(late) < len(felts)
