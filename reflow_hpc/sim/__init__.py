"""The discrete-event simulator: the second driver of :class:`reflow_hpc.core.coordinator.Coordinator`
(DESIGN §4), in simulated time, with cost models of a GPU cluster.

- ``engine.py``: the event loop; simulated workers carry out the coordinator's commands.
- ``costs.py``: decode, prefill, training, weight sync, role switches, tool calls (``[sim]`` keys).
- ``lengths.py``: prompt and response lengths, groups, the cap mass, drift.
- ``workload.py``: a mode's config, the placement of GPUs into workers, the coordinator.
- ``report.py``: one run end to end and its summary; ``plots.py``: figures.
- ``calibrate.py``: the calibration gate and the cross-check against real CPU runs; ``fit.py``: the CPU
  cost model fitted to the machine of a ``tools/bench_modes.py`` run.

``python -m reflow_hpc.sim --help`` for the command line.
"""
