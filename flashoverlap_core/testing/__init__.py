"""The FlashOverlap conformance suite: any backend, in-tree or out-of-tree, runs it with

    pytest --pyargs flashoverlap_core.testing --fo-backend NAME

``NAME`` is a registered backend name or ``module:attr``. Options (see ``pytest --help``):
``--fo-world-sizes`` (default 1,2,3,4 on the host, up to 4 devices on an accelerator),
``--fo-seed`` (default: fresh each run, printed in the header; pass it back to reproduce) and
``--fo-timeout`` (seconds a rank may take for one call before the call counts as a hang).
``FLASHOVERLAP_REQUIRE_HW=1`` turns "backend or hardware unavailable" skips into failures.

What it checks: the three collectives and a custom op, float32/float16/bfloat16, world sizes 1-4
on spawned ranks, ragged shapes, transposed ``b``, several wave groupings, all_to_all splits with
zeros, against a float64 reference recomputed from per-rank seeds, with poisoned outputs and an
element-wise error bound; the plan invariants (property tests); and that every kind of invalid
argument is rejected with ValueError/TypeError before the backend does any device work.
"""
