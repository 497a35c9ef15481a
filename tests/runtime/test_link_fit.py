"""profile_link's conversion of measured message times into ``(latency, bandwidth)``, given the times (no ranks):
``time = latency + bytes / bandwidth`` by least squares; the latency falls back to the least time when the
intercept is not positive; the bandwidth is ``inf`` when the fitted slope is not positive (the latency then the
times' mean). Every result is one a LayerProfile takes."""
import dataclasses
import math

import pytest

from pipesched.profile import LayerProfile
from pipesched.runtime.link_profile import _bandwidth, _fit

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 22]  # profile_link's default nbytes


def link(sizes, times):
    """What profile_link returns for these measured times: the fit, then its slope as bytes/s."""
    latency, seconds_per_byte = _fit(sizes, times)
    return latency, _bandwidth(seconds_per_byte)


def usable(latency, bandwidth):
    p = LayerProfile(forward=[1.0], input_grad=[1.0], weight_grad=[0.0], activation_bytes=[0], output_bytes=[0],
                     param_bytes=[0], microbatch_size=1)
    return dataclasses.replace(p, latency=latency, bandwidth=bandwidth)


def test_times_on_a_line_give_its_latency_and_bandwidth():
    latency, bandwidth = 2.0 ** -15, 2.0 ** 30  # ~30.5 us, 1 GiB/s
    times = [latency + n / bandwidth for n in SIZES]
    got = link(SIZES, times)
    assert got == (pytest.approx(latency, rel=1e-12), pytest.approx(bandwidth, rel=1e-12))
    assert usable(*got).bandwidth == pytest.approx(bandwidth, rel=1e-12)
    assert link(SIZES[::-1], times[::-1]) == got  # the order of the points does not matter
    assert _fit(SIZES, times) == (pytest.approx(latency, rel=1e-12), pytest.approx(1 / bandwidth, rel=1e-12))


def test_noisy_times_are_fitted_by_least_squares():
    sizes, times = [0, 1000, 2000], [1e-5, 3e-5, 4e-5]  # slope 1.5e-8 s/B, intercept 1.1667e-5 s
    latency, bandwidth = link(sizes, times)
    assert latency == pytest.approx(3.5e-5 / 3, rel=1e-12) and bandwidth == pytest.approx(1 / 1.5e-8, rel=1e-12)


def test_a_negative_intercept_falls_back_to_the_smallest_size_time():
    sizes, times = [1, 2, 3], [1e-6, 4e-6, 9e-6]  # slope 4e-6 s/B; intercept 14/3 - 8 < 0 us
    latency, bandwidth = link(sizes, times)
    assert latency == 1e-6 and bandwidth == pytest.approx(250_000.0, rel=1e-12)  # the slope is kept


def test_the_fallback_is_the_least_time_when_noise_made_a_larger_message_quicker():
    sizes, times = [1, 2, 3], [2e-6, 1e-6, 9e-6]  # slope 3.5e-6 s/B; intercept 4 - 7 < 0 us
    latency, bandwidth = link(sizes, times)
    assert latency == 1e-6 and bandwidth == pytest.approx(1 / 3.5e-6, rel=1e-12)


def test_an_intercept_of_exactly_zero_falls_back_too():
    sizes, times = [1, 2], [2.0 ** -20, 2.0 ** -19]  # through the origin exactly (binary fractions)
    assert _fit(sizes, times) == (2.0 ** -20, 2.0 ** -20)
    assert link(sizes, times) == (2.0 ** -20, 2.0 ** 20)


@pytest.mark.parametrize("times, latency", [
    ([5e-6] * 4, 5e-6),  # flat: the time does not grow with the size
    ([4e-6, 3e-6, 2e-6, 1e-6], 2.5e-6),  # falling (noise): slope 0, the intercept is the mean
])
def test_times_that_do_not_grow_give_an_infinite_bandwidth(times, latency):
    got = link(SIZES, times)
    assert got == (pytest.approx(latency, rel=1e-12), math.inf)
    assert _fit(SIZES, times)[1] == 0.0
    assert usable(*got).bandwidth == math.inf


def test_times_below_the_clock_resolution_give_a_free_link():
    assert link(SIZES, [0.0] * 4) == (0.0, math.inf)
    assert usable(0.0, math.inf).latency == 0.0


def test_bandwidth_of_a_slope():
    assert _bandwidth(2.0 ** -30) == 2.0 ** 30
    assert _bandwidth(1e-9) == pytest.approx(1e9, rel=1e-15)
    assert _bandwidth(0.0) == math.inf and _bandwidth(-1e-9) == math.inf
