"""hookscope: see inside any PyTorch model, and change it, through PyTorch's own hooks.

Capture inputs, outputs and gradients of chosen modules, extract features, intervene on
values and gradients, tap intermediate tensors, monitor and diagnose training, and show it.

Names are imported on first use (PEP 562): ``import hookscope`` alone imports neither torch
nor anything else heavy, so the ``hookscope`` command (``watch``, ``report``, ``diff``) starts
at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# public name -> the module that defines it
_WHERE = {
    "Capture": "._capture",
    "capture": "._capture",
    "compare": "._compare",
    "FeatureStore": "._dataset",
    "extract_dataset": "._dataset",
    "Finding": "._diagnose",
    "Thresholds": "._diagnose",
    "CompiledModelError": "._errors",
    "ExplainError": "._errors",
    "FeatureStoreError": "._errors",
    "HookscopeError": "._errors",
    "HookscopeWarning": "._errors",
    "InterventionError": "._errors",
    "LayoutError": "._errors",
    "MissingRecordError": "._errors",
    "NeverCalledWarning": "._errors",
    "NoGradWarning": "._errors",
    "NonFiniteError": "._errors",
    "SelectionError": "._errors",
    "TargetError": "._errors",
    "UnsupportedModelError": "._errors",
    "Explanation": "._explain",
    "explain": "._explain",
    "explain_dataset": "._explain._dataset",
    "Probe": "._explain._probe",
    "extract": "._extract",
    "LogitLens": "._interp",
    "Patching": "._interp",
    "Steering": "._interp",
    "logit_lens": "._interp",
    "patching": "._interp",
    "steer": "._interp",
    "Intervention": "._intervene",
    "intervene": "._intervene",
    "read_log": "._log",
    "Monitor": "._monitor",
    "Record": "._record",
    "Replay": "._monitor._nonfinite._replay",
    "replay": "._monitor._nonfinite._replay",
    "report": "._report",
    "select": "._select",
    "JsonlSink": "._sinks",
    "MemorySink": "._sinks",
    "Sink": "._sinks",
    "TensorBoardSink": "._sinks",
    "Site": "._hooks",
    "summary": "._summary",
    "Tap": "._tap",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ._capture import Capture as Capture
    from ._capture import capture as capture
    from ._compare import compare as compare
    from ._dataset import FeatureStore as FeatureStore
    from ._dataset import extract_dataset as extract_dataset
    from ._diagnose import Finding as Finding
    from ._diagnose import Thresholds as Thresholds
    from ._errors import CompiledModelError as CompiledModelError
    from ._errors import ExplainError as ExplainError
    from ._errors import FeatureStoreError as FeatureStoreError
    from ._errors import HookscopeError as HookscopeError
    from ._errors import HookscopeWarning as HookscopeWarning
    from ._errors import InterventionError as InterventionError
    from ._errors import LayoutError as LayoutError
    from ._errors import MissingRecordError as MissingRecordError
    from ._errors import NeverCalledWarning as NeverCalledWarning
    from ._errors import NoGradWarning as NoGradWarning
    from ._errors import NonFiniteError as NonFiniteError
    from ._errors import SelectionError as SelectionError
    from ._errors import TargetError as TargetError
    from ._errors import UnsupportedModelError as UnsupportedModelError
    from ._explain import Explanation as Explanation
    from ._explain import explain as explain
    from ._explain._dataset import explain_dataset as explain_dataset
    from ._explain._probe import Probe as Probe
    from ._extract import extract as extract
    from ._hooks import Site as Site
    from ._interp import LogitLens as LogitLens
    from ._interp import Patching as Patching
    from ._interp import Steering as Steering
    from ._interp import logit_lens as logit_lens
    from ._interp import patching as patching
    from ._interp import steer as steer
    from ._intervene import Intervention as Intervention
    from ._intervene import intervene as intervene
    from ._log import read_log as read_log
    from ._monitor import Monitor as Monitor
    from ._monitor._nonfinite._replay import Replay as Replay
    from ._monitor._nonfinite._replay import replay as replay
    from ._record import Record as Record
    from ._report import report as report
    from ._select import select as select
    from ._sinks import JsonlSink as JsonlSink
    from ._sinks import MemorySink as MemorySink
    from ._sinks import Sink as Sink
    from ._sinks import TensorBoardSink as TensorBoardSink
    from ._summary import summary as summary
    from ._tap import Tap as Tap


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hookscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "Capture",
    "CompiledModelError",
    "ExplainError",
    "Explanation",
    "FeatureStore",
    "FeatureStoreError",
    "Finding",
    "HookscopeError",
    "HookscopeWarning",
    "Intervention",
    "InterventionError",
    "JsonlSink",
    "LayoutError",
    "LogitLens",
    "MemorySink",
    "MissingRecordError",
    "Monitor",
    "NeverCalledWarning",
    "NoGradWarning",
    "NonFiniteError",
    "Patching",
    "Probe",
    "Record",
    "Replay",
    "SelectionError",
    "Sink",
    "Site",
    "Steering",
    "Tap",
    "TargetError",
    "TensorBoardSink",
    "Thresholds",
    "UnsupportedModelError",
    "capture",
    "compare",
    "explain",
    "explain_dataset",
    "extract",
    "extract_dataset",
    "intervene",
    "logit_lens",
    "patching",
    "read_log",
    "replay",
    "report",
    "select",
    "steer",
    "summary",
]
