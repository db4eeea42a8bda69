"""Tuners: pure state machines that turn events (``Start``, ``Result``, ``Failed``) into actions
(``Submit``, ``Stop``, ``Finish``); see ``base`` for the protocol, ``registry`` for names, and
``simulate`` for drivers that run them without a server."""

from stagetree.client.tuners.asha import ASHA
from stagetree.client.tuners.base import (
    Action,
    Best,
    Event,
    Failed,
    Finish,
    Result,
    Start,
    Stop,
    Submit,
    Trial,
    Tuner,
)
from stagetree.client.tuners.basic import GridTuner, RandomTuner
from stagetree.client.tuners.early_stop import EarlyStopTuner, Milestone, Schedule
from stagetree.client.tuners.halving import SHA, Hyperband
from stagetree.client.tuners.median import MedianStopping
from stagetree.client.tuners.pbt import PBT
from stagetree.client.tuners.registry import TUNERS, make_tuner, tuner_factory
from stagetree.client.tuners.simulate import Run, run_sync, simulate

__all__ = [
    "ASHA",
    "PBT",
    "SHA",
    "TUNERS",
    "Action",
    "Best",
    "EarlyStopTuner",
    "Event",
    "Failed",
    "Finish",
    "GridTuner",
    "Hyperband",
    "MedianStopping",
    "Milestone",
    "RandomTuner",
    "Result",
    "Run",
    "Schedule",
    "Start",
    "Stop",
    "Submit",
    "Trial",
    "Tuner",
    "make_tuner",
    "run_sync",
    "simulate",
    "tuner_factory",
]
