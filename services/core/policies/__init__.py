"""Scheduling policies of the four other systems (Hermes, HyperDrive POP, HyperSack, GENIE) and their baselines.

Each paper's method is a pure plug-in step of the scheduling pipeline (ARCHITECTURE §5), with the
baselines its paper compared against beside it, and an event-driven simulator that reproduces the
comparison (``tests/bench/policies.py``):

============  ==================================================  ===================================
module        step and entry points                               simulator
============  ==================================================  ===================================
``hermes``    Preempt: ``node_round``, ``time_share_policy``;     ``hermes_sim.simulate_time_sharing``
              Place: ``place_jobs`` / ``find_available_gpu``
``pop``       Order + kill/suspend: ``search_policy`` (SAP with   ``pop_sim.simulate_search``
              ``on_epoch``, ``next_job``, ``priority``)
``curves``    learning-curve model: ``fit_curve`` -> ``CurveFit``
``packing``   Place: ``place``, ``exact_place``, ``Usage``,       ``packing_sim.simulate_packing``
              ``ProfileBook``
``genie``     Order + Place for multi-GPU work with deadlines:    ``genie_sim.simulate_qos``
              ``plan_queue``, ``launch``, ``fit_perf_model``
============  ==================================================  ===================================

``live`` is the step of the live master's round that applies them per study; ``state`` keeps what that
step learns across rounds, with a per-study ``snapshot``/``restore`` as plain JSON so that it survives a
change of leading master. Everything here takes plain data and returns plain data; randomness is seeded.
"""
