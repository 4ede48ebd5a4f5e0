"""The ``hookscope`` command: a thin shell over the public API.

Exit status: 0 on success, 1 for an error hookscope reports (``HookscopeError``, a module or
factory that cannot be loaded), 2 for a usage error; ``diff`` follows diff(1): 0 when the runs
agree, 1 when they part, 2 when they cannot be compared. Errors go to stderr as ``Error: ...``
followed by a ``Try 'hookscope <cmd> --help'`` hint; expected errors print no traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._errors import HookscopeError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with click-style errors: ``Error: ...`` and a hint naming the command's help."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        sys.stderr.write(f"Error: {message}\nTry '{self.prog} --help' for help.\n")
        raise SystemExit(2)


class _UserError(HookscopeError):
    """An error in what the user asked for, reported with exit status 1."""


# The demo's faults (``_demo.FAULTS``, which a test keeps in step), named here so that the
# parser, built for every command, does not import the demo and with it torch.
DEMO_FAULTS = ("none", "nan", "dead", "explode", "vanish")


def _parser() -> _Parser:
    root = _Parser(prog="hookscope", description="See inside any PyTorch model through its hooks.")
    root.add_argument("--version", action="version", version=_version())
    sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="train a small CNN on the bundled digits with a monitor attached and write a report",
        description="Train a small CNN on scikit-learn's bundled 8x8 digits (no download) with a "
        "Monitor attached; write the JSON-lines log, TensorBoard events (if installed) and "
        "report.html; print the accuracy and the findings. --fault injects a pathology.",
    )
    demo.add_argument(
        "--out",
        default="hookscope-demo",
        metavar="DIR",
        help="output directory (default: %(default)s)",
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=4, metavar="N", help="epochs (default: %(default)s)"
    )
    demo.add_argument(
        "--fault",
        choices=DEMO_FAULTS,
        default="none",
        help="pathology to inject (default: %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(run=_demo)

    report = sub.add_parser(
        "report",
        help="write the HTML report of a monitored run",
        description="Write one self-contained HTML file from a run's log (LOG_DIR/hookscope.jsonl).",
    )
    report.add_argument(
        "log_dir", metavar="LOG_DIR", help="the Monitor's log_dir, or the .jsonl file"
    )
    report.add_argument(
        "-o", "--out", metavar="FILE", help="output file (default: LOG_DIR/report.html)"
    )
    report.set_defaults(run=_report)

    diff = sub.add_parser(
        "diff",
        help="print the first module and step where two monitored runs part",
        description="Compare two runs of one model step by step, modules in execution order, "
        "and print the first statistic that differs beyond the tolerance (or the step where "
        "the shorter run ended). Exit status, as diff(1)'s: 0 when the runs agree, 1 when they "
        "part, 2 when they cannot be compared (a log missing or unreadable, runs of different "
        "models, a bad option).",
    )
    diff.add_argument("log_a", metavar="LOG_A", help="the first run's log_dir, or its .jsonl")
    diff.add_argument("log_b", metavar="LOG_B", help="the second run's")
    diff.add_argument(
        "--rtol",
        type=_tolerance,
        default=1e-3,
        help="relative tolerance, >= 0 (default: %(default)s)",
    )
    diff.add_argument(
        "--atol",
        type=_tolerance,
        default=1e-6,
        help="absolute tolerance, >= 0 (default: %(default)s)",
    )
    diff.set_defaults(run=_diff)

    summ = sub.add_parser(
        "summary",
        help="print a table of a model's modules, shapes and parameter counts",
        description="Import MODULE, call FACTORY() to build the model, run one forward pass on "
        "torch.zeros(SHAPE) and print the table.",
    )
    summ.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="e.g. torchvision.models:resnet18 or mymodels:build",
    )
    summ.add_argument(
        "--input", required=True, metavar="SHAPE", type=_shape, help="input shape, e.g. 1,3,32,32"
    )
    summ.add_argument(
        "--dtype", default="float32", help="input dtype (default: %(default)s; long for token ids)"
    )
    summ.add_argument("--json", action="store_true", help="print the summary as JSON")
    summ.set_defaults(run=_summary)

    rep = sub.add_parser(
        "replay",
        help="re-run a flight-recorder bundle and name the op and line that made the NaN/Inf",
        description="Load a replay bundle (written by hs.Monitor(..., record_dir=DIR)) into the "
        "model built by MODULE:FACTORY, re-run the recorded step under an op-level tracer and "
        "print the finding, the op, the module and the source line.",
    )
    rep.add_argument("bundle", metavar="BUNDLE", help="the bundle directory")
    rep.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a function that builds the model the same way as the recorded run",
    )
    rep.set_defaults(run=_replay)

    wat = sub.add_parser(
        "watch",
        help="run a training command unchanged and monitor the model(s) it trains",
        usage="hookscope watch [options] -- COMMAND [ARGS...]",
        description="Run COMMAND (python train.py ..., torchrun ...) unchanged, with a Monitor "
        "on every model whose parameters its optimizers step, found through torch's global "
        "optimizer hooks. Writes DIR/hookscope.jsonl and DIR/report.html (a second model: "
        "DIR/<ModelClass>/), also when the command crashes or is killed; prints the findings "
        "as they come; exits with the command's exit status (128 + N if killed by signal N).",
        epilog="example: hookscope watch --every 50 -- python train.py --lr 3e-4",
    )
    wat.add_argument(
        "--out",
        default="hookscope-watch",
        metavar="DIR",
        help="log directory (default: %(default)s)",
    )
    wat.add_argument(
        "--every",
        type=_positive_int,
        default=10,
        metavar="N",
        help="statistics every N optimizer steps (default: %(default)s)",
    )
    wat.add_argument(
        "--where",
        action="append",
        metavar="W",
        help="modules to watch, a name or glob such as 'encoder.*' (repeatable; default: every "
        "leaf module)",
    )
    wat.add_argument(
        "--on-nonfinite",
        choices=["log", "raise", "skip"],
        default="log",
        help="on a NaN/Inf: log it, raise NonFiniteError in the script, or skip that update "
        "(default: %(default)s)",
    )
    wat.add_argument(
        "--check",
        choices=["edges", "modules"],
        default="edges",
        help="where the non-finite check looks on every step: the model's edges, a replay "
        "naming the module (edges), or every module's output and gradient (modules: names "
        "the module without a replay, at a cost; default: %(default)s)",
    )
    wat.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    wat.set_defaults(run=_watch, parser=wat)
    return root


def _version() -> str:
    from ._version import __version__

    return f"hookscope {__version__}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0 (0 compares exactly), got {text!r}"
        )
    return value


def _shape(text: str) -> tuple[int, ...]:
    parts = [p for p in re.split(r"[,x\s()\[\]]+", text.strip()) if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a shape such as 1,3,32,32, got {text!r}")
    return tuple(int(p) for p in parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (HookscopeError, ImportError) as exc:
        name = args.run.__name__.lstrip("_")  # (watch's own `command` is the command it runs)
        sys.stderr.write(f"Error: {exc}\nTry 'hookscope {name} --help' for help.\n")
        return 1


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo
    from ._paths import check_writable

    check_writable(args.out, "the demo's log and report", "--out ")  # before the training
    result = run_demo(
        args.out,
        epochs=args.epochs,
        fault=args.fault,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(f"test accuracy: {result.accuracy:.2%}  ({result.steps} steps in {result.seconds:.1f} s)")
    if result.findings:
        print(f"findings ({len(result.findings)}):")
        for f in result.findings:
            print(f"  step {f.step:>4}  {f.kind:<20} {f.module}: {f.message}")
    else:
        print("findings: none")
    print(f"log: {result.log_dir / 'hookscope.jsonl'}")
    if result.tensorboard:
        print(f"tensorboard: tensorboard --logdir {result.log_dir}")
    print(f"report: {result.report}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from ._report import report

    print(report(args.log_dir, args.out))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from ._compare import compare

    try:
        found = compare(args.log_a, args.log_b, rtol=args.rtol, atol=args.atol)
    except HookscopeError as exc:  # not comparable: diff(1)'s "trouble", not "they differ"
        sys.stderr.write(f"Error: {exc}\nTry 'hookscope diff --help' for help.\n")
        return 2
    if found is None:
        print(f"the runs agree (rtol={args.rtol:g}, atol={args.atol:g})")
        return 0
    print(found)
    return 1


def _summary(args: argparse.Namespace) -> int:
    import torch

    from ._summary import summary

    model = _build(args.target)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise _UserError(f"unknown dtype {args.dtype!r}; try float32, float16 or long")
    try:
        result = summary(model, torch.zeros(args.input, dtype=dtype))
    except HookscopeError:
        raise
    except Exception as exc:  # the user's model failed on this input: say so without a traceback
        raise _UserError(
            f"{args.target} failed on an input of shape {list(args.input)} ({args.dtype}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        _print_table(result)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ._monitor._nonfinite._replay import check_bundle, replay

    check_bundle(args.bundle)  # before the model is built: a missing bundle says so first
    model = _build(args.model)
    print(replay(args.bundle, model))
    return 0


def _watch(args: argparse.Namespace) -> int:
    from ._watch import watch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.parser.error(
            "watch needs a command to run after '--', e.g. hookscope watch -- python train.py"
        )
    return watch(
        command,
        out=args.out,
        every=args.every,
        where=args.where,
        on_nonfinite=args.on_nonfinite,
        check=args.check,
    )


def _print_table(result: Any) -> None:
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        try:
            from rich.console import Console
        except ImportError:
            pass
        else:
            Console().print(result)
            return
    print(result)


def _build(target: str) -> Any:
    """The model ``MODULE:FACTORY`` builds, or an error saying why there is none."""
    import torch

    factory = _load_factory(target)
    try:
        model = factory()
    except Exception as exc:  # the user's factory failed: say so without a traceback
        raise _UserError(
            f"{target}() failed: {type(exc).__name__}: {exc}. FACTORY is called with no "
            "arguments and must build and return the model (a function such as "
            "mymodels:build, not a class that needs arguments)"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise _UserError(f"{target} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _load_factory(target: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise _UserError(f"expected MODULE:FACTORY such as mymodels:build, got {target!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules in the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _UserError(f"cannot import module {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise _UserError(f"module {module_name!r} has no attribute {attr!r}.{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _UserError(f"{target} is not callable; FACTORY must build and return the model")
    return obj
