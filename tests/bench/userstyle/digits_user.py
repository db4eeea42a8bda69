"""A user's trainer module for ``tests.bench.vs_raytune``: the digits MLP of the examples, in a module that
imports what users' modules import (optuna, scikit-learn, scipy), so every process that imports it (Ray's
actors, stagetree's workers) pays for them as a user's would."""

from __future__ import annotations

import optuna  # noqa: F401  (a user's module imports its tuner's library)
import scipy.stats  # noqa: F401
import sklearn.model_selection  # noqa: F401

from stagetree.nodemanager.examples.digits import DigitsMLP


class DigitsNet(DigitsMLP):
    """The examples' digits MLP, unchanged."""
