"""Scheduling policies of the four other systems (Hermes, HyperDrive POP, HyperSack, GENIE) and their baselines.

Each paper's method is a pure plug-in of the scheduling round's steps (ARCHITECTURE §5,
``stagetree.core.round``), with the baselines its paper compared against beside it, each registered by
name so that a study selects it (``study.parse_policies``):

============  ==========================================================  ==========================
module        step and entry points                                       registry
============  ==========================================================  ==========================
``hermes``    Preempt: ``node_round``; Place: ``find_available_gpu``;     ``TIME_SHARE_POLICIES``
              Order: ``TimeSharePolicy.score``
``pop``       Order + kill/suspend: ``search_policy`` (SAP with           ``SEARCH_POLICIES``
              ``on_epoch``, ``next_job``, ``priority``)
``curves``    learning-curve model: ``fit_curve`` -> ``CurveFit``
``packing``   Place: ``place``, ``exact_place``, ``Usage``, ``ProfileBook`` ``PLACE_POLICIES``
``genie``     Order + width of multi-slot work with deadlines:            ``WIDTH_POLICIES``,
              ``choose_width``; the paper's queue planner ``plan_queue``   ``QUEUE_POLICIES``
============  ==========================================================  ==========================

``study`` validates what a study chooses; ``state`` keeps what the round's policies learn across rounds,
with a per-study ``snapshot``/``restore`` as plain JSON so that it survives a change of leading master.
The papers' comparisons run these through the round on ``core.simulator`` (``tests/bench/policies.py``).
Everything here takes plain data and returns plain data; randomness is seeded.
"""
