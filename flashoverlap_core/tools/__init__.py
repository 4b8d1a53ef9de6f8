"""The ``flashoverlap`` command and what it is built from: the top layer of the package.

* :mod:`.cli` — the command, one subcommand per module: :mod:`.bench` (the main job),
  :mod:`.report`, :mod:`.build` (kernels ahead of time), :mod:`.tune`, :mod:`.trace`;
* :mod:`.hardware` — which backend, device type and number of ranks a command runs on;
* :mod:`.ranks` — spawned ranks in one process group (:class:`~.ranks.RankPool`, and
  :class:`~.ranks.Ranks`, which restarts a pool a failed call killed);
* :mod:`.args`, :mod:`.progress`, :mod:`.table`, :mod:`.plot` — arguments, progress lines,
  text tables and the timeline plot.

Tools import the library; nothing in the library imports them: ``import flashoverlap_core``
loads none of this (tests/test_layers.py). The scripts in ``bench/`` build on these modules.
"""
