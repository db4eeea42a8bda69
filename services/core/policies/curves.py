"""Probabilistic learning-curve extrapolation (Domhan et al., IJCAI 2015), the predictor behind POP and EarlyTerm.

HyperDrive (§3.1.1, §5.2) asks one question of a partial learning curve ``y(1..n)``: what is
``P(y(m) >= y_target | y(1..n))`` for future epochs ``m``? Domhan et al. answer it with a weighted
combination of parametric curve families whose parameters are sampled by MCMC. This module answers it
with the same kind of model and an equivalent Bayesian method that is exact up to quadrature and needs
nothing beyond numpy:

* **families** (Domhan's increasing families, reparameterized so that every one is *linear* in its level
  parameters): ``pow3``, ``pow4``, ``ilog2``, ``weibull``, ``mmf``, ``hill3``, and ``exp_pow``, Domhan's
  weighted combination of an exponential and a power law (a fast phase, then a slow tail). Each is
  ``f(x) = B(x; phi) @ beta`` with up to two nonlinear shape parameters ``phi`` (rates, exponents) and up
  to three level parameters ``beta`` (asymptote, drops at the first epoch);
* **prior**: ``phi`` log-uniform on a box, ``beta`` uniform on ``[0, 1]`` restricted to curves that rise
  and stay within ``[0, 1]`` (metrics are normalized first; HyperDrive Eq. 4 does min-max scaling),
  Jeffreys' prior on the Gaussian noise ``sigma``;
* **likelihood** raised to the power ``1 / tempering`` (a power posterior, "safe Bayes"): no family fits a
  real curve exactly, the residuals are correlated, and the plain posterior is overconfident. On the
  synthetic CIFAR-like traces of ``tests/sim/papers/pop.py``, tempering 3 brings the 80% predictive interval of the
  accuracy at epoch 120, from 10-50 observed epochs, to 70-98% coverage (60-75% untempered);
* **posterior**: ``phi`` on a grid (quadrature, refined once around the mass), ``beta`` and ``sigma``
  integrated in closed form (the Gaussian-linear model gives a Student-t marginal), the truncation of
  ``beta`` to the constrained box accounted for by a seeded Monte Carlo estimate of the mass inside it;
* **ensemble**: Bayesian model averaging, each family weighted by its marginal likelihood (Domhan samples
  linear-combination weights instead; both yield a posterior-predictive mixture over families);
* **predictive samples**: grid point by posterior weight, then ``sigma`` and ``beta`` from their exact
  conditionals, rejecting draws outside the prior's constraints.

Compared to MCMC there is no convergence to worry about; a fit costs a few milliseconds per family and
is deterministic for a given ``seed``.

``fit_curve(xs, ys, seed=...)`` returns a ``CurveFit``; ``prob_reached(target, xs)`` gives the cumulative
probability that the curve has reached ``target`` by each future ``x``: exactly the ``P(m)`` that POP's
Eq. 1-3 difference into ``p_m``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stagetree.core.errors import InvalidArgument

Array = npt.NDArray[np.float64]
Basis = Callable[[Array, Array], list[Array]]  # (phi (G, q), x (T,)) -> the p columns of B, each (G, T)
Curve = Callable[[Array, Array], Array]  # (params (N, q + p), x (T,)) -> f (N, T)

DEFAULT_TEMPERING = 3.0
START_TOLERANCE = 0.05  # how far below 0 the first-epoch value may be (noise around a 0 start)
_FAR = 1e4  # the "asymptote" of the rise check, in epochs
_MIN_RSS_PER_POINT = 1e-8  # a noise floor, so a perfectly flat curve does not give infinite evidence


@dataclass(frozen=True)
class Family:
    """A parametric family ``f(x) = B(x; phi) @ beta``.

    ``phi`` (names ``shape``) is log-uniform on ``[10**lo, 10**hi]`` per parameter and sits on a
    ``grid``-point axis each; ``beta`` (names ``level``) is uniform on ``[0, 1]`` each. ``curve`` evaluates
    the family from natural parameters ``(phi..., beta...)``.
    """

    name: str
    shape: tuple[str, ...]
    level: tuple[str, ...]
    lo: tuple[float, ...]
    hi: tuple[float, ...]
    basis: Basis
    curve: Curve
    grid: int = 24

    @property
    def params(self) -> tuple[str, ...]:
        return self.shape + self.level


def _c(p: Array, i: int) -> Array:
    return p[:, i : i + 1]


def _pow3_basis(phi: Array, x: Array) -> list[Array]:
    return [np.ones((len(phi), len(x))), -(x[None, :] ** (-phi[:, 0:1]))]


def _pow3(p: Array, x: Array) -> Array:
    return _c(p, 1) - _c(p, 2) * x ** (-_c(p, 0))


def _pow4_g(s: Array, alpha: Array, x: Array) -> Array:
    return ((x + s) / (1.0 + s)) ** (-alpha)  # type: ignore[no-any-return]


def _pow4_basis(phi: Array, x: Array) -> list[Array]:
    return [np.ones((len(phi), len(x))), -_pow4_g(phi[:, 0:1], phi[:, 1:2], x[None, :])]


def _pow4(p: Array, x: Array) -> Array:
    return _c(p, 2) - _c(p, 3) * _pow4_g(_c(p, 0), _c(p, 1), x)


def _ilog2_basis(phi: Array, x: Array) -> list[Array]:
    g = np.broadcast_to(math.log(2.0) / np.log(x + 1.0), (phi.shape[0], len(x)))
    return [np.ones((len(phi), len(x))), -g]


def _ilog2(p: Array, x: Array) -> Array:
    return _c(p, 0) - _c(p, 1) * math.log(2.0) / np.log(x + 1.0)


def _weibull_g(k: Array, d: Array, x: Array) -> Array:
    return np.exp(-((k * x) ** d))  # type: ignore[no-any-return]


def _mmf_g(k: Array, d: Array, x: Array) -> Array:
    return 1.0 / (1.0 + (k * x) ** d)  # type: ignore[no-any-return]


def _saturating(g_of: Callable[[Array, Array, Array], Array]) -> tuple[Basis, Curve]:
    """``f = alpha - (alpha - beta) g(x)`` with ``g`` falling from 1 to 0: asymptote alpha, start beta."""

    def basis(phi: Array, x: Array) -> list[Array]:
        g = g_of(phi[:, 0:1], phi[:, 1:2], x[None, :])
        return [1.0 - g, g]

    def curve(p: Array, x: Array) -> Array:
        g = g_of(_c(p, 0), _c(p, 1), x)
        return _c(p, 2) * (1.0 - g) + _c(p, 3) * g

    return basis, curve


def _hill3_h(eta: Array, kappa: Array, x: Array) -> Array:
    xe = x**eta
    return xe / (kappa**eta + xe)  # type: ignore[no-any-return]


def _hill3_basis(phi: Array, x: Array) -> list[Array]:
    return [_hill3_h(phi[:, 0:1], phi[:, 1:2], x[None, :])]


def _hill3(p: Array, x: Array) -> Array:
    return _c(p, 2) * _hill3_h(_c(p, 0), _c(p, 1), x)


def _exp_pow_basis(phi: Array, x: Array) -> list[Array]:
    return [np.ones((len(phi), len(x))), -np.exp(-phi[:, 0:1] * (x[None, :] - 1.0)), -(x[None, :] ** (-phi[:, 1:2]))]


def _exp_pow(p: Array, x: Array) -> Array:
    return _c(p, 2) - _c(p, 3) * np.exp(-_c(p, 0) * (x - 1.0)) - _c(p, 4) * x ** (-_c(p, 1))


_weibull_basis, _weibull = _saturating(_weibull_g)
_mmf_basis, _mmf = _saturating(_mmf_g)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        # pow3: c - a x^-alpha (a is the drop below the asymptote at epoch 1)
        Family("pow3", ("alpha",), ("c", "a"), (-2.0,), (0.7,), _pow3_basis, _pow3, grid=48),
        # pow4: c - a ((x + s) / (1 + s))^-alpha, Domhan's c - (a x + b)^-alpha with the drop at epoch 1 as a
        Family("pow4", ("s", "alpha"), ("c", "a"), (-1.0, -2.0), (2.0, 0.7), _pow4_basis, _pow4),
        # ilog2: c - a log(2) / log(x + 1)
        Family("ilog2", (), ("c", "a"), (), (), _ilog2_basis, _ilog2, grid=1),
        # weibull: alpha - (alpha - beta) exp(-(kappa x)^delta)  (Janoschek is the same family reparameterized)
        Family("weibull", ("kappa", "delta"), ("alpha", "beta"), (-3.0, -0.6), (0.3, 0.6), _weibull_basis, _weibull),
        # mmf: alpha - (alpha - beta) / (1 + (kappa x)^delta)
        Family("mmf", ("kappa", "delta"), ("alpha", "beta"), (-3.0, -0.6), (0.3, 0.6), _mmf_basis, _mmf),
        # hill3: ymax x^eta / (kappa^eta + x^eta)  (Domhan's log power is the same family reparameterized)
        Family("hill3", ("eta", "kappa"), ("ymax",), (-0.7, -0.3), (0.7, 3.3), _hill3_basis, _hill3),
        # exp_pow: c - a1 exp(-kappa (x - 1)) - a2 x^-alpha, Domhan's weighted combination of exp3 and pow3
        # (a fast phase and a slow tail), its weights absorbed into the level parameters
        Family("exp_pow", ("kappa", "alpha"), ("c", "a1", "a2"), (-2.0, -2.0), (0.5, 0.7), _exp_pow_basis, _exp_pow),
    )
}
DEFAULT_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def _box_grid(lo: Sequence[float], hi: Sequence[float], n: int) -> Array:
    """Cell midpoints (G, q) of an ``n``-per-axis grid over the log10 box ``[lo, hi]``, in natural units."""
    if not lo:
        return np.zeros((1, 0))
    axes = [10.0 ** (a + (b - a) * (np.arange(n) + 0.5) / n) for a, b in zip(lo, hi, strict=True)]
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1)


def _allowed(fam: Family, phi: Array, beta: Array) -> npt.NDArray[np.bool_]:
    """The prior's constraints on (G, S, p) level draws at (G, q) shape points: levels in [0, 1], the curve
    rising from its first-epoch value, which is not below ``-START_TOLERANCE``."""
    ok = np.all((beta >= 0.0) & (beta <= 1.0), axis=2)
    g_n, s_n, _ = beta.shape
    params = np.concatenate([np.repeat(phi[:, None, :], s_n, axis=1), beta], axis=2).reshape(g_n * s_n, -1)
    with np.errstate(all="ignore"):
        ends = fam.curve(params, np.array([1.0, _FAR])).reshape(g_n, s_n, 2)
    ok &= np.isfinite(ends).all(axis=2)
    ok &= (ends[:, :, 0] >= -START_TOLERANCE) & (ends[:, :, 1] >= ends[:, :, 0]) & (ends[:, :, 1] <= 1.0)
    return ok  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Marginal:
    """Per grid point of one family: the least-squares levels, their precision, RSS and log evidence."""

    phi: Array  # (G, q)
    beta_hat: Array  # (G, p)
    chol_inv: Array  # (G, p, p): L^-T / sqrt(nu) with B^T B = L L^T: beta = beta_hat + sigma * chol_inv @ z
    rss: Array  # (G,) nu * residual sum of squares
    dof: float
    log_ml: Array  # (G,) log p(y | phi) with the levels and sigma integrated out, before truncation


def _marginal(fam: Family, phi: Array, x: Array, y: Array, nu: float) -> _Marginal:
    t_n = len(x)
    p_n = len(fam.level)
    dof = nu * t_n - p_n
    with np.errstate(all="ignore"):
        cols = fam.basis(phi, x)
        # The Gram matrix, its Cholesky factor and inverse; in closed form for one or two level parameters.
        a = np.sum(cols[0] * cols[0], axis=1)
        r0 = cols[0] @ y
        chol_inv = np.zeros((len(phi), p_n, p_n))
        if p_n == 1:
            beta_hat = (r0 / a)[:, None]
            rss = float(y @ y) - beta_hat[:, 0] * r0
            logdet = np.log(a)
            chol_inv[:, 0, 0] = 1.0 / np.sqrt(a)
        elif p_n == 2:
            bb = np.sum(cols[0] * cols[1], axis=1)
            c = np.sum(cols[1] * cols[1], axis=1)
            r1 = cols[1] @ y
            det = a * c - bb * bb
            beta_hat = np.stack([(c * r0 - bb * r1) / det, (a * r1 - bb * r0) / det], axis=1)
            rss = float(y @ y) - beta_hat[:, 0] * r0 - beta_hat[:, 1] * r1
            logdet = np.log(det)
            l11 = np.sqrt(a)
            l22 = np.sqrt(det / a)
            chol_inv[:, 0, 0] = 1.0 / l11  # (L^T)^-1 with L L^T the Gram matrix
            chol_inv[:, 0, 1] = -(bb / l11) / (l11 * l22)
            chol_inv[:, 1, 1] = 1.0 / l22
        else:
            b = np.stack(cols, axis=2)
            bt = np.swapaxes(b, 1, 2)
            gram = bt @ b + np.eye(p_n)[None] * 1e-12
            r = (bt @ y[None, :, None])[:, :, 0]
            chol = np.linalg.cholesky(gram)
            beta_hat = np.linalg.solve(gram, r[:, :, None])[:, :, 0]
            rss = float(y @ y) - np.sum(beta_hat * r, axis=1)
            logdet = 2.0 * np.sum(np.log(np.diagonal(chol, axis1=1, axis2=2)), axis=1)
            chol_inv = np.linalg.inv(np.swapaxes(chol, 1, 2))
        rss = nu * np.maximum(rss, _MIN_RSS_PER_POINT * t_n)
        # Flat unit-box prior on the levels (volume 1), Jeffreys on sigma, the likelihood to the power nu:
        # p(y | phi) = Gamma(dof/2) / 2 * (pi nu RSS)^(-dof/2) * nu^(-p/2) * |B^T B|^(-1/2), dof = nu T - p
        log_ml = (
            math.lgamma(dof / 2) - math.log(2.0) - 0.5 * dof * np.log(math.pi * rss) - 0.5 * p_n * math.log(nu)
        ) - 0.5 * logdet
    good = np.isfinite(log_ml) & np.all(np.isfinite(beta_hat), axis=1)
    log_ml = np.where(good, log_ml, -np.inf)
    return _Marginal(phi, np.nan_to_num(beta_hat), np.nan_to_num(chol_inv) / math.sqrt(nu), rss, dof, log_ml)


def _draw(m: _Marginal, idx: npt.NDArray[np.intp], rng: np.random.Generator) -> Array:
    """Levels drawn from their exact conditional at grid points ``idx`` (shape (G', S)): (G', S, p)."""
    sigma2 = m.rss[idx] / rng.chisquare(m.dof, size=idx.shape)
    z = rng.standard_normal((*idx.shape, m.beta_hat.shape[1]))
    noise = np.sum(m.chol_inv[idx] * z[:, :, None, :], axis=3) * np.sqrt(sigma2)[:, :, None]
    return m.beta_hat[idx] + noise  # type: ignore[no-any-return]


@dataclass(frozen=True)
class CurveFit:
    """A posterior-predictive mixture: per family, equally weighted samples of its natural parameters."""

    families: tuple[str, ...]
    weights: tuple[float, ...]  # posterior family probabilities, summing to 1
    samples: tuple[Array, ...]  # per family, (N, len(params)) natural parameters
    log_evidence: tuple[float, ...]

    def curves(self, xs: Sequence[float]) -> list[Array]:
        """Noise-free curve samples at ``xs``: per family an (N, len(xs)) array."""
        x = np.asarray(xs, dtype=np.float64)
        out = []
        for name, s in zip(self.families, self.samples, strict=True):
            with np.errstate(all="ignore"):
                out.append(np.nan_to_num(FAMILIES[name].curve(s, x), nan=-np.inf))
        return out

    def _expect(self, per_family: Sequence[Array]) -> Array:
        total = np.zeros_like(per_family[0], dtype=np.float64)
        for wk, v in zip(self.weights, per_family, strict=True):
            if wk > 0:
                total = total + wk * v
        return total

    def prob_reached(self, target: float, xs: Sequence[float]) -> list[float]:
        """``P(max_{x' <= x} y(x') >= target)`` for each ``x`` of ascending ``xs``: a CDF over future epochs.

        For the rising curves of the prior this is ``P(y(x) >= target)`` (HyperDrive Eq. 1); the running
        maximum keeps it a valid cumulative distribution whatever the samples do.
        """
        per = [np.mean(np.maximum.accumulate(c, axis=1) >= target, axis=0) for c in self.curves(xs)]
        return [min(max(float(v), 0.0), 1.0) for v in self._expect(per)]

    def prob_at_least(self, target: float, x: float) -> float:
        """``P(y(x) >= target)`` under the noise-free curve (EarlyTerm's ``p_val``)."""
        p = float(self._expect([np.mean(c[:, :1] >= target, axis=0) for c in self.curves([x])])[0])
        return min(max(p, 0.0), 1.0)

    def mean(self, xs: Sequence[float]) -> list[float]:
        return [float(v) for v in self._expect([np.mean(c, axis=0) for c in self.curves(xs)])]

    def std(self, xs: Sequence[float]) -> list[float]:
        """Standard deviation across all samples (HyperDrive's prediction accuracy PA)."""
        curves = self.curves(xs)
        m = self._expect([np.mean(c, axis=0) for c in curves])
        second = self._expect([np.mean(c**2, axis=0) for c in curves])
        return [float(v) for v in np.sqrt(np.maximum(second - m**2, 0.0))]


def fit_curve(
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    seed: int = 0,
    samples: int = 200,
    families: Sequence[str] = DEFAULT_FAMILIES,
    truncation_draws: int = 8,
    tempering: float = DEFAULT_TEMPERING,
) -> CurveFit:
    """Posterior over the families given observations ``ys`` (normalized to [0, 1]) at epochs ``xs`` (>= 1).

    A family takes part when there are at least ``tempering * (levels + 1)`` points (the tempered
    likelihood needs a positive number of degrees of freedom); with too few points for every family it
    raises ``InvalidArgument``.
    """
    if len(xs) != len(ys) or not xs:
        raise InvalidArgument(f"fit_curve: need as many xs as ys and at least one, got {len(xs)}/{len(ys)}")
    if any(x < 1 for x in xs):
        raise InvalidArgument("fit_curve: xs must be >= 1 (epochs count from 1)")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise InvalidArgument(f"fit_curve: unknown families {unknown}; known: {sorted(FAMILIES)}")
    if tempering < 1.0:
        raise InvalidArgument(f"fit_curve: tempering must be >= 1, got {tempering}")
    if samples < 1 or truncation_draws < 1:
        raise InvalidArgument(
            f"fit_curve: samples and truncation_draws must be >= 1, got {samples}, {truncation_draws}"
        )
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    rng = np.random.default_rng(seed)
    names: list[str] = []
    log_ev: list[float] = []
    fitted: list[Array] = []
    for name in families:
        fam = FAMILIES[name]
        if len(x) / tempering - len(fam.level) < 1:
            continue
        post = _posterior(fam, x, y, rng, truncation_draws, 1.0 / tempering)
        if post is None:
            continue
        m, w, log_ev_fam = post
        names.append(name)
        log_ev.append(log_ev_fam)
        fitted.append(_sample(fam, m, w, samples, rng))
    if not names:
        raise InvalidArgument(f"fit_curve: {len(x)} points are too few for families {list(families)}")
    ev = np.asarray(log_ev)
    wts = np.exp(ev - ev.max())
    wts /= wts.sum()
    return CurveFit(tuple(names), tuple(float(v) for v in wts), tuple(fitted), tuple(log_ev))


def _grid_posterior(
    fam: Family, phi: Array, x: Array, y: Array, rng: np.random.Generator, draws: int, nu: float
) -> tuple[_Marginal, Array]:
    """Log posterior (unnormalized, truncation included) at the grid points ``phi``."""
    m = _marginal(fam, phi, x, y, nu)
    log_post = np.full(len(phi), -np.inf)
    # Only points within e^-30 of the best matter; the truncated mass is estimated there alone.
    live = np.flatnonzero(m.log_ml >= np.max(m.log_ml) - 30.0)
    if len(live) and math.isfinite(float(np.max(m.log_ml))):
        idx = np.repeat(live[:, None], draws, axis=1)
        inside = np.mean(_allowed(fam, m.phi[live], _draw(m, idx, rng)), axis=1)
        with np.errstate(divide="ignore"):
            log_post[live] = m.log_ml[live] + np.log(inside)
    return m, log_post


def _posterior(
    fam: Family, x: Array, y: Array, rng: np.random.Generator, draws: int, nu: float
) -> tuple[_Marginal, Array, float] | None:
    """The shape grid's posterior weights and the family's log evidence; the grid is refined once around
    the posterior mass, so a sharp posterior (a long curve) is not stuck between coarse grid points."""
    n = fam.grid
    m, lp = _grid_posterior(fam, _box_grid(fam.lo, fam.hi, n), x, y, rng, draws, nu)
    top = float(np.max(lp))
    if not math.isfinite(top):
        return None
    # log evidence: the prior on the shape box is uniform in log10 units, so average over equal cells
    log_ev = top + math.log(float(np.sum(np.exp(lp - top))) / len(lp))
    if fam.shape:
        q = len(fam.shape)
        cells = np.stack(np.unravel_index(np.flatnonzero(lp >= top - 20.0), (n,) * q), axis=1)
        width = [(h - l_) / n for l_, h in zip(fam.lo, fam.hi, strict=True)]
        lo = [fam.lo[i] + max(int(cells[:, i].min()) - 1, 0) * width[i] for i in range(q)]
        hi = [fam.lo[i] + min(int(cells[:, i].max()) + 2, n) * width[i] for i in range(q)]
        m, lp = _grid_posterior(fam, _box_grid(lo, hi, n), x, y, rng, draws, nu)
        top = float(np.max(lp))
        if not math.isfinite(top):
            return None
        frac = math.prod((h - l_) / (fh - fl) for l_, h, fl, fh in zip(lo, hi, fam.lo, fam.hi, strict=True))
        log_ev = top + math.log(float(np.sum(np.exp(lp - top))) / len(lp) * frac)
    w = np.exp(lp - top)
    return m, w / w.sum(), log_ev


def _sample(fam: Family, m: _Marginal, post: Array, n: int, rng: np.random.Generator) -> Array:
    """``n`` posterior draws of (phi, beta) within the prior's constraints (fewer if rejection keeps failing)."""
    out: list[Array] = []
    have = 0
    for _ in range(20):
        idx = rng.choice(len(post), size=(1, 2 * (n - have)), p=post)
        beta = _draw(m, idx, rng)
        ok = _allowed(fam, m.phi[idx[0]], np.swapaxes(beta, 0, 1))[:, 0]
        good = np.concatenate([m.phi[idx[0][ok]], beta[0][ok]], axis=1)[: n - have]
        out.append(good)
        have += len(good)
        if have >= n:
            break
    res = np.concatenate(out, axis=0) if out else np.zeros((0, len(fam.params)))
    if len(res) == 0:  # keep the fit usable: the least-squares levels at the best grid point, clipped
        best = int(np.argmax(post))
        res = np.concatenate([m.phi[best], np.clip(m.beta_hat[best], 0.0, 1.0)])[None, :]
    return res
