"""Every ```python block of the README runs, in order, in one namespace."""

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(blocks()) >= 4


@pytest.mark.slow
def test_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks()):
        try:
            exec(compile(code, f"README.md block {i}", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"README block {i} failed: {exc!r}\n{code}") from exc
    assert os.listdir(tmp_path)  # the tour writes its run log and report here
