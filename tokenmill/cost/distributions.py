"""Token-count distributions for workload estimates, with the two moments pricing needs.

Linear pricing needs only the mean. The long-context rule re-prices a request whose
prompt exceeds a threshold T, so an estimate also needs, for each T,

    tail(T) = (P(X > T), E[X * 1{X > T}])

the share of requests above T and the partial mean of their token counts. Both are
computed analytically (closed forms below), not by sampling; `sample` exists so tests
can check the closed forms against a seeded Monte Carlo. Counts are treated as
continuous (tokens are integers, but P(X = T) is zero or negligible for the
continuous families; `fixed` uses the exact rule `value > T`).

Families (parameters as written in a workload file):
- `fixed`: `value` (a bare number means this too).
- `uniform`: `low`, `high`, continuous on [low, high].
- `normal`: `mean`, `std`, truncated at 0 since counts are never negative (with
  mean >= 3 std the truncation is negligible, and mean() reports the truncated mean).
- `lognormal`: `sigma` (of log X) and either `mean` (arithmetic mean of X) or
  `median`; the usual shape of prompt lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from decimal import Decimal
from statistics import NormalDist
from typing import Protocol

from tokenmill.cost.values import ConfigError, Fields, to_decimal

_STD = NormalDist()


class Distribution(Protocol):
    def mean(self) -> Decimal: ...

    def tail(self, threshold: int) -> tuple[Decimal, Decimal]:
        """(P(X > threshold), E[X * 1{X > threshold}])."""
        ...

    def sample(self, rng: random.Random) -> float: ...

    def describe(self) -> str: ...


def _d(x: float) -> Decimal:
    return to_decimal(float(x))


@dataclass(frozen=True)
class Fixed:
    value: Decimal

    def mean(self) -> Decimal:
        return self.value

    def tail(self, threshold: int) -> tuple[Decimal, Decimal]:
        return (Decimal(1), self.value) if self.value > threshold else (Decimal(0), Decimal(0))

    def sample(self, rng: random.Random) -> float:
        return float(self.value)

    def describe(self) -> str:
        return f"fixed {self.value}"


@dataclass(frozen=True)
class Uniform:
    low: Decimal
    high: Decimal

    def mean(self) -> Decimal:
        return (self.low + self.high) / 2

    def tail(self, threshold: int) -> tuple[Decimal, Decimal]:
        t = Decimal(threshold)
        if t >= self.high:
            return Decimal(0), Decimal(0)
        if t < self.low:
            return Decimal(1), self.mean()
        width = self.high - self.low
        # integral of x / width over [t, high]
        return (self.high - t) / width, (self.high * self.high - t * t) / (2 * width)

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(float(self.low), float(self.high))

    def describe(self) -> str:
        return f"uniform [{self.low}, {self.high}]"


@dataclass(frozen=True)
class Normal:
    """N(mean, std) conditioned on X > 0."""

    mu: Decimal
    std: Decimal

    def _partial(self, c: float) -> float:
        # E[X 1{X > c}] for the untruncated normal: mu (1 - Phi(z)) + std phi(z)
        mu, sd = float(self.mu), float(self.std)
        z = (c - mu) / sd
        return mu * (1 - _STD.cdf(z)) + sd * _STD.pdf(z)

    def _mass_above_zero(self) -> float:
        return 1 - _STD.cdf(-float(self.mu) / float(self.std))

    def mean(self) -> Decimal:
        return _d(self._partial(0.0) / self._mass_above_zero())

    def tail(self, threshold: int) -> tuple[Decimal, Decimal]:
        c = max(0.0, float(threshold))
        z0 = self._mass_above_zero()
        prob = (1 - _STD.cdf((c - float(self.mu)) / float(self.std))) / z0
        return _d(prob), _d(self._partial(c) / z0)

    def sample(self, rng: random.Random) -> float:
        while True:
            x = rng.gauss(float(self.mu), float(self.std))
            if x > 0:
                return x

    def describe(self) -> str:
        return f"normal mean {self.mu} std {self.std} (truncated at 0)"


@dataclass(frozen=True)
class LogNormal:
    """log X ~ N(mu, sigma)."""

    mu: float
    sigma: float

    def mean(self) -> Decimal:
        return _d(math.exp(self.mu + self.sigma ** 2 / 2))

    def tail(self, threshold: int) -> tuple[Decimal, Decimal]:
        if threshold <= 0:
            return Decimal(1), self.mean()
        log_t = math.log(threshold)
        prob = 1 - _STD.cdf((log_t - self.mu) / self.sigma)
        # E[X 1{X > T}] = E[X] * Phi((mu + sigma^2 - ln T) / sigma)
        partial = math.exp(self.mu + self.sigma ** 2 / 2) * _STD.cdf((self.mu + self.sigma ** 2 - log_t) / self.sigma)
        return _d(prob), _d(partial)

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(self.mu, self.sigma)

    def describe(self) -> str:
        return f"lognormal median {math.exp(self.mu):.0f} sigma {self.sigma:g} (mean {self.mean():.0f})"


def parse_distribution(value: object, where: str, field: str,
                       error: type[ConfigError] = ConfigError) -> Distribution:
    """A distribution from a bare number (fixed) or a table with `distribution = ...`."""
    if not isinstance(value, dict):
        try:
            number = to_decimal(value)
        except TypeError:
            raise error(f"{where}: '{field}' must be a number or a distribution table, got {value!r}") from None
        if number < 0:
            raise error(f"{where}: '{field}' must be >= 0, got {value}")
        return Fixed(number)
    f = Fields(value, where, error, prefix=f"{field}.")
    kind = f.text("distribution", "fixed")
    if kind == "fixed":
        f.only(("distribution", "value", "mean"))
        if f.has("value") == f.has("mean"):
            raise f.fail(f"'{field}' fixed needs exactly one of 'value' or 'mean'")
        return Fixed(f.number("value" if f.has("value") else "mean"))
    if kind == "uniform":
        f.only(("distribution", "low", "high"))
        low, high = f.number("low"), f.number("high")
        if high < low:
            raise f.fail(f"'{field}.high' ({high}) must be >= '{field}.low' ({low})")
        return Fixed(low) if high == low else Uniform(low, high)
    if kind == "normal":
        f.only(("distribution", "mean", "std"))
        return Normal(f.number("mean", positive=True), f.number("std", positive=True))
    if kind == "lognormal":
        f.only(("distribution", "mean", "median", "sigma"))
        sigma = float(f.number("sigma", positive=True))
        if f.has("mean") == f.has("median"):
            raise f.fail(f"'{field}' lognormal needs exactly one of 'mean' or 'median' (with 'sigma')")
        if f.has("mean"):
            return LogNormal(math.log(float(f.number("mean", positive=True))) - sigma ** 2 / 2, sigma)
        return LogNormal(math.log(float(f.number("median", positive=True))), sigma)
    raise f.fail(f"'{field}.distribution' must be fixed, uniform, normal or lognormal, got {kind!r}")
