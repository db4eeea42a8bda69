"""Example trainers: ``digits.DigitsMLP`` (fast, used by tests, demo and benchmarks) and
``faults.FaultyDigits`` (the same with injectable faults)."""
