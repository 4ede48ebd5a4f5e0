"""Rules that turn a Monitor's per-step statistics into findings.

Thresholds start from the published ones (DeepDiagnosis, ICSE'22; AutoTrainer, ICSE'21) and
are all parameters of :class:`Thresholds`. Every finding carries its evidence in the message.

A rule judges a condition over a span of *training steps*, not of sampled ones, so ``every``
changes when a finding is first seen, not whether: the condition must hold on at least two
observations in a row that lie at least the rule's span apart (span 0: one observation). A
finding clears the same way: when its condition has failed on two observations in a row, at
least its span apart; :meth:`Diagnosis.cleared` hands it back with ``cleared_at`` set.

The package, one concern a module, each importing only the ones above it in this list:

- ``_finding``: :class:`Finding` and :func:`mark_cleared`;
- ``_thresholds``: :class:`Thresholds`, every threshold with its source;
- ``_runs``: how a condition lasts over training steps (``Run``, ``Growth``);
- ``_graph``: :class:`Graph`, which module fed which, and the walks along it;
- ``_lifecycle``: which findings were reported, are current, cleared;
- ``_training``: every training step's scalars (learning rates, updates, the loss) and the
  divergence rule;
- ``_activations``, ``_large_model``, ``_precision``, ``_gradients``, ``_updates``: the rules
  on sampled steps;
- ``_diagnosis``: :class:`Diagnosis`, which runs them all.

Like the log, the diagnosis imports no torch: it reads records, nothing else.
"""

from __future__ import annotations

from ._diagnosis import Diagnosis
from ._finding import Finding, mark_cleared
from ._graph import Graph
from ._thresholds import Thresholds

__all__ = ["Diagnosis", "Finding", "Graph", "Thresholds", "mark_cleared"]
