"""Settings for the whole suite."""

from hypothesis import settings

# The property tests check what holds, not how fast: a loaded machine stretches one example past
# Hypothesis' default 200 ms deadline, which then fails a correct test as "unreliable timings".
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
