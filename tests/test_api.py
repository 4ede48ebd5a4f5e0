"""The public API: the contract's names are importable, and `import hookscope` stays light."""

import ast
import subprocess
import sys
from pathlib import Path

import hookscope as hs

CONTRACT = [
    "select",
    "SelectionError",
    "capture",
    "extract",
    "intervene",
    "Tap",
    "Monitor",
    "Finding",
    "NonFiniteError",
    "summary",
    "report",
    "explain",
    "Explanation",
    "explain_dataset",
    "Probe",
]


def test_contract_names_are_public() -> None:
    missing = [name for name in CONTRACT if name not in hs.__all__ or not hasattr(hs, name)]
    assert missing == []


def test_all_lists_only_existing_names() -> None:
    assert all(hasattr(hs, name) for name in hs.__all__)


def test_every_error_and_warning_is_public_and_defined_in_one_module() -> None:
    """A user can catch each error hookscope raises by its own name, and the old import
    paths give the same class."""
    from hookscope import _capture, _errors
    from hookscope._dataset import _format

    defined = {
        name
        for name, value in vars(_errors).items()
        if isinstance(value, type) and issubclass(value, (hs.HookscopeError, hs.HookscopeWarning))
    }
    assert {"MissingRecordError", "FeatureStoreError", "NonFiniteError"} <= defined
    assert sorted(defined - set(hs.__all__)) == []
    assert all(getattr(hs, name) is getattr(_errors, name) for name in defined)
    assert _capture.MissingRecordError is hs.MissingRecordError
    assert _format.FeatureStoreError is hs.FeatureStoreError
    assert issubclass(hs.MissingRecordError, KeyError)
    assert issubclass(hs.FeatureStoreError, ValueError)


def test_import_hookscope_imports_no_optional_dependency() -> None:
    # Compared with what `import torch` alone loads (torch itself pulls in tqdm when present).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import hookscope\n"
        "heavy = ['matplotlib', 'tensorboard', 'rich', 'tqdm', 'sklearn', 'transformers',"
        " 'accelerate', 'lightning', 'pytorch_lightning', 'torch._dynamo', 'numpy']\n"
        "print([m for m in heavy if m in sys.modules and m not in before])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imports(path: Path, *, typing: bool = True) -> set[str]:
    """Modules of the package that ``path`` imports (relative imports), and top-level
    third-party names it imports; ``typing=False``: not those only a type checker runs
    (``if TYPE_CHECKING:``)."""
    package = path.parent
    found = set()
    tree = ast.parse(path.read_text())
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split("."))
            names = [target] if node.module else [base / alias.name for alias in node.names]
            for t in names:
                candidates = [t.with_suffix(".py"), t / "__init__.py", t.parent / "__init__.py"]
                # ``from . import name``: the module ``name``, or a name of the package
                where = next((c for c in candidates if c.is_file()), None)
                if where is not None:
                    found.add(str(where.relative_to(SRC)))
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.endswith(".py"):
            todo.extend(_imports(SRC / name))
    return seen


SRC = Path(hs.__file__).parent
RUNS_A_MODEL = {
    "_capture.py",
    "_extract.py",
    "_intervene.py",
    "_summary.py",
    "_hooks/__init__.py",
    "_hooks/_set.py",
    "_hooks/_points.py",
    "_hooks/_compile.py",
    "_monitor/__init__.py",
    "_monitor/_nonfinite/_trace.py",
    "_monitor/_nonfinite/_replay.py",
    "_dataset/_run.py",
    "_watch/_agent.py",
    "_record.py",
}


def test_everything_after_the_hook_is_plain_data() -> None:
    """The log, sinks, diagnosis and report never import code that runs a model, and the
    log and the diagnosis not even torch: they read records, nothing else."""
    for start in ("_log.py", "_diagnose/__init__.py", "_sinks.py", "_report/__init__.py"):
        reached = _closure(start)
        assert not reached & RUNS_A_MODEL, (start, reached & RUNS_A_MODEL)
    for start in ("_log.py", "_diagnose/__init__.py"):
        assert "torch" not in _closure(start), start


FRAMEWORKS = {"lightning", "pytorch_lightning", "transformers", "accelerate"}


def test_only_the_integrations_import_a_training_framework() -> None:
    """``import hookscope`` reaches no integration module, and only ``integrations/<name>.py``
    names a training framework (imported at its top: the user opts in by importing it)."""
    reached = _closure("__init__.py")
    assert not {m for m in reached if m.startswith("integrations/")}
    for path in SRC.rglob("*.py"):
        name = str(path.relative_to(SRC))
        if name not in ("integrations/lightning.py", "integrations/transformers.py"):
            assert not _imports(path) & FRAMEWORKS, name
    assert {"lightning", "pytorch_lightning"} <= _imports(SRC / "integrations/lightning.py")
    assert "transformers" in _imports(SRC / "integrations/transformers.py")


def _room(name: str, depth: int = 1) -> str:
    """A file's folder ``depth`` levels below the package (``_monitor``, then
    ``_monitor/_step``, ...), or the file itself where it lies higher."""
    return "/".join(name.split("/")[:depth])


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph``, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_imports_run_one_way() -> None:
    """Files import downward only: no import cycle between files (lazy imports included;
    ``TYPE_CHECKING`` ones are not run) nor between the package's folders, and nothing
    inside imports the front door (``__init__.py``)."""
    files = {str(p.relative_to(SRC)): p for p in SRC.rglob("*.py")}
    graph = {
        name: {m for m in _imports(path, typing=False) if m in files and m != name}
        for name, path in files.items()
    }
    assert _cycle(graph) == []
    for depth in (1, 2):  # the package's folders, then the folders inside each folder
        rooms: dict[str, set[str]] = {}
        for name, targets in graph.items():
            rooms.setdefault(_room(name, depth), set()).update(
                _room(t, depth)
                for t in targets
                if _room(t, depth) != _room(name, depth) and (depth == 1 or _room(t) == _room(name))
            )
        for name in list(rooms):  # a front door imports every room behind it
            if name.endswith("__init__.py"):
                rooms.pop(name)
        assert _cycle(rooms) == [], depth
    assert not [name for name, targets in graph.items() if "__init__.py" in targets]
    absolute = [
        name
        for name, path in files.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "hookscope")
        or (isinstance(node, ast.Import) and any(a.name == "hookscope" for a in node.names))
    ]
    assert absolute == []


def test_no_module_imports_another_modules_private_name() -> None:
    """A name with a leading underscore stays in its module: what two modules share gets a
    public-in-package name in the lower one (``from ._capture import _helper`` is refused;
    importing a private *module*, ``from . import _log``, is fine)."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split("."))
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                is_module = (target / f"{alias.name}.py").is_file() or (
                    target / alias.name
                ).is_dir()
                if private and not is_module:
                    where = str(target.relative_to(SRC)).removesuffix("/__init__")
                    found.add((str(path.relative_to(SRC)), where, alias.name))
    assert found == set(), sorted(found)
