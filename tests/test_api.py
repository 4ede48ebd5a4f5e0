"""The public API: the contract's names are importable, and `import hookscope` stays light."""

import subprocess
import sys

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
]


def test_contract_names_are_public() -> None:
    missing = [name for name in CONTRACT if name not in hs.__all__ or not hasattr(hs, name)]
    assert missing == []


def test_all_lists_only_existing_names() -> None:
    assert all(hasattr(hs, name) for name in hs.__all__)


def test_import_hookscope_imports_no_optional_dependency() -> None:
    # Compared with what `import torch` alone loads (torch itself pulls in tqdm when present).
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import hookscope\n"
        "heavy = ['matplotlib', 'tensorboard', 'rich', 'tqdm', 'sklearn', 'transformers',"
        " 'torch._dynamo', 'numpy']\n"
        "print([m for m in heavy if m in sys.modules and m not in before])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
