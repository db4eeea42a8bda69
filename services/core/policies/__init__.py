"""Scheduling policies of the four other systems (Hermes, HyperDrive POP, HyperSack, GENIE) and their baselines."""
