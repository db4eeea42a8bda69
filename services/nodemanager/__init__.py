"""The node manager service (one per GPU server) and the worker runtime it runs batches with.

- :mod:`.agent`      ``NodeManager``: register, heartbeat, carry out the assignment stream, reconnect
- :mod:`.link`       the ``MasterLink`` port and ``GrpcMasterLink``
- :mod:`.reporting`  the ``BatchReporter`` port, ``BusReporter`` (bus) and ``GrpcReporter`` (direct)
- :mod:`.workers`    ``WorkerLauncher``: warm worker processes per slot, batch after batch, started ahead
- :mod:`.reuse`      whether a warm worker runs the next batch or is replaced (pure decisions)
- :mod:`.slots`      slots from GPUs (shares, CPU-only fallback) and each worker's environment
- :mod:`.gpu`        the ``GpuProbe`` port and ``NvmlGpuProbe`` (pynvml)
- :mod:`.mps`        the node manager's own CUDA MPS control daemon
- :mod:`.settings`   ``NodeManagerSettings`` (``STAGETREE_NM_*``); :mod:`.app` builds a node manager from them
- :mod:`.cli`        ``stagetree nodemanager run``
- :mod:`.runtime`    what runs inside a worker process (needs torch)

Nothing is imported here, so ``stagetree nodemanager --help`` does not import torch.
"""
