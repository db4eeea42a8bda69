"""stagetree: hyper-parameter optimization that shares the training of common schedule prefixes.

The public SDK is re-exported here (``stagetree.connect``, ``stagetree.Trainer``, search spaces, tuners).
"""

from __future__ import annotations

__version__ = "0.1.0"
