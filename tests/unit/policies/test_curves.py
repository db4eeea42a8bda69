"""The learning-curve model: its closed-form evidence against quadrature, its predictions, its contract."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies import curves
from stagetree.core.policies.curves import FAMILIES, fit_curve


def weibull(x: np.ndarray, a: float = 0.8, b: float = 0.1, k: float = 1 / 30, d: float = 1.0) -> np.ndarray:
    return a - (a - b) * np.exp(-((k * x) ** d))


def test_marginal_likelihood_matches_numerical_integration() -> None:
    """log p(y | phi) with one level parameter, its flat prior and Jeffreys' sigma integrated in closed
    form, equals a brute-force double integral over (level, log sigma)."""
    fam = FAMILIES["hill3"]
    phi = np.array([[1.3, 12.0]])  # eta, kappa
    x = np.array([1.0, 2.0, 4.0, 7.0, 11.0])
    h = (x**1.3) / (12.0**1.3 + x**1.3)
    y = 0.7 * h + np.array([0.01, -0.02, 0.015, 0.0, -0.01])
    m = curves._marginal(fam, phi, x, y, 1.0)
    betas = np.linspace(0.0, 1.6, 1601)[:, None]
    log_sigmas = np.linspace(math.log(1e-3), math.log(1.0), 1201)[None, :]
    sig = np.exp(log_sigmas)
    rss = ((y[None, :] - betas * h[None, :]) ** 2).sum(axis=1)[:, None]
    # d(sigma) / sigma = d(log sigma): the Jeffreys prior becomes flat in log sigma
    lik = (2 * math.pi * sig**2) ** (-len(x) / 2) * np.exp(-rss / (2 * sig**2))
    integral = np.trapezoid(np.trapezoid(lik, log_sigmas[0], axis=1), betas[:, 0])
    assert m.log_ml[0] == pytest.approx(math.log(integral), abs=1e-3)


def test_tempering_broadens_without_moving_the_least_squares_fit() -> None:
    fam = FAMILIES["weibull"]
    phi = np.array([[1 / 30, 1.0]])
    x = np.arange(1.0, 21.0)
    y = weibull(x) + 0.005 * np.sin(x)
    plain = curves._marginal(fam, phi, x, y, 1.0)
    tempered = curves._marginal(fam, phi, x, y, 1 / 3)
    assert np.allclose(plain.beta_hat, tempered.beta_hat)
    assert np.all(np.abs(tempered.chol_inv) >= np.abs(plain.chol_inv) - 1e-15)
    assert tempered.dof == pytest.approx(len(x) / 3 - 2)


def test_a_long_clean_curve_is_extrapolated_accurately() -> None:
    x = np.arange(1, 61)
    y = weibull(x) + np.random.default_rng(0).normal(0, 0.005, len(x))
    fit = fit_curve(list(x), list(y), seed=1)
    assert sum(fit.weights) == pytest.approx(1.0)
    truth = float(weibull(np.array([120.0]))[0])
    assert fit.mean([120])[0] == pytest.approx(truth, abs=0.03)
    assert fit.prob_reached(truth - 0.05, [120])[0] > 0.9
    assert fit.prob_reached(truth + 0.08, [120])[0] < 0.1


def test_few_points_leave_the_future_uncertain() -> None:
    x = np.arange(1, 11)
    early = fit_curve(list(x), list(weibull(x)), seed=2)
    late = fit_curve(list(np.arange(1, 61)), list(weibull(np.arange(1, 61))), seed=2)
    assert early.std([120])[0] > 2 * late.std([120])[0]


@settings(max_examples=12, deadline=None)
@given(
    a=st.floats(0.3, 0.95),
    k=st.floats(0.01, 0.3),
    n=st.integers(8, 40),
    noise=st.floats(0.0, 0.02),
    seed=st.integers(0, 1000),
    target=st.floats(0.2, 0.99),
)
def test_prob_reached_is_a_cdf(a: float, k: float, n: int, noise: float, seed: int, target: float) -> None:
    x = np.arange(1, n + 1)
    y = np.clip(weibull(x, a=a, k=k) + np.random.default_rng(seed).normal(0, noise, n), 0, 1)
    fit = fit_curve(list(x), list(y), seed=seed)
    cdf = fit.prob_reached(target, [float(v) for v in range(n + 1, n + 60)])
    assert all(0.0 <= p <= 1.0 for p in cdf)
    assert all(b >= a_ - 1e-12 for a_, b in itertools.pairwise(cdf))
    # Every sample obeys the prior: a rising curve within [0, 1].
    for name, s in zip(fit.families, fit.samples, strict=True):
        ends = FAMILIES[name].curve(s, np.array([1.0, 1e4]))
        assert np.all(ends[:, 1] >= ends[:, 0] - 1e-9) and np.all(ends[:, 1] <= 1.0 + 1e-9)


def test_same_seed_same_answer_and_bad_input_is_refused() -> None:
    x, y = [1, 2, 3, 4, 5, 6], [0.1, 0.2, 0.3, 0.35, 0.4, 0.42]
    one, two = fit_curve(x, y, seed=5), fit_curve(x, y, seed=5)
    assert one.weights == two.weights and one.prob_reached(0.5, [20, 40]) == two.prob_reached(0.5, [20, 40])
    with pytest.raises(InvalidArgument):
        fit_curve([1, 2], [0.1], seed=0)
    with pytest.raises(InvalidArgument):
        fit_curve([0, 1, 2], [0.1, 0.2, 0.3], seed=0)
    with pytest.raises(InvalidArgument, match="known"):
        fit_curve(x, y, families=["nope"])
    with pytest.raises(InvalidArgument, match="too few"):
        fit_curve([1, 2], [0.1, 0.2])
