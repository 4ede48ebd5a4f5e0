"""``hs.explain``: where the model looks (class activation maps) and layer attribution.

- ``_explain.py``: the public function; ``_result.py``: the :class:`Explanation` it returns
  (heatmaps, overlays, PNG files, metrics, notebook view).
- ``_run.py``: the runner, :func:`explain_batch`: one batch in, plain tensors out (what a
  probe during training or a data set calls).
- ``_forward.py``: the hooked forward pass (values copied at hook time, gradients only down
  to the module); ``_rerun.py``: Score-CAM's masked passes and integrated gradients.
- ``_methods.py``: the formulas; ``_layout.py``: outputs read as grids (NCHW, NHWC, tokens);
  ``_target.py``: which score; ``_inputs.py``: the inputs; ``_state.py``: the model put
  back as it was; ``_metrics.py``: faithfulness; ``_png.py``: colours and PNG files.
"""

from ._explain import explain
from ._inputs import Inputs
from ._layout import LAYOUTS, Layout
from ._methods import METHODS
from ._metrics import Metrics
from ._result import Explanation
from ._run import Explained, explain_batch

__all__ = [
    "LAYOUTS",
    "METHODS",
    "Explained",
    "Explanation",
    "Inputs",
    "Layout",
    "Metrics",
    "explain",
    "explain_batch",
]
