"""hookscope: see inside any PyTorch model, and change it, through PyTorch's own hooks.

Capture inputs, outputs and gradients of chosen modules, extract features, intervene on
values and gradients, tap intermediate tensors, monitor and diagnose training, and show it.
"""

from ._capture import Capture as Capture
from ._capture import capture as capture
from ._compare import compare as compare
from ._dataset import FeatureStore as FeatureStore
from ._dataset import extract_dataset as extract_dataset
from ._diagnose import Finding as Finding
from ._diagnose import Thresholds as Thresholds
from ._errors import CompiledModelError as CompiledModelError
from ._errors import HookscopeError as HookscopeError
from ._errors import HookscopeWarning as HookscopeWarning
from ._errors import InterventionError as InterventionError
from ._errors import NeverCalledWarning as NeverCalledWarning
from ._errors import NoGradWarning as NoGradWarning
from ._errors import NonFiniteError as NonFiniteError
from ._errors import SelectionError as SelectionError
from ._extract import extract as extract
from ._intervene import Intervention as Intervention
from ._intervene import intervene as intervene
from ._log import read_log as read_log
from ._monitor import Monitor as Monitor
from ._record import Record as Record
from ._replay import Replay as Replay
from ._replay import replay as replay
from ._report import report as report
from ._select import select as select
from ._sinks import JsonlSink as JsonlSink
from ._sinks import MemorySink as MemorySink
from ._sinks import Sink as Sink
from ._sinks import TensorBoardSink as TensorBoardSink
from ._sites import Site as Site
from ._summary import summary as summary
from ._tap import Tap as Tap
from ._version import __version__ as __version__

__all__ = [
    "Capture",
    "CompiledModelError",
    "FeatureStore",
    "Finding",
    "HookscopeError",
    "HookscopeWarning",
    "Intervention",
    "InterventionError",
    "JsonlSink",
    "MemorySink",
    "Monitor",
    "NeverCalledWarning",
    "NoGradWarning",
    "NonFiniteError",
    "Record",
    "Replay",
    "SelectionError",
    "Sink",
    "Site",
    "Tap",
    "TensorBoardSink",
    "Thresholds",
    "capture",
    "compare",
    "extract",
    "extract_dataset",
    "intervene",
    "read_log",
    "replay",
    "report",
    "select",
    "summary",
]
