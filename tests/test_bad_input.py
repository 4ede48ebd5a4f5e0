"""The bad inputs of a newcomer's first day (research/newcomer-4.md, section 3): each one gets
a clear error that names the problem and the fix, or a sensible result, and the model is left
as it was. Logs are never corrupted or silently overwritten: a notebook cell run twice, two
Monitors on one ``log_dir``, a new run in an old run's directory."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hookscope as hs
import models
from hookscope._cli import main
from hookscope.testing import assert_no_hooks, hooks_on

UNWRITABLE = "/proc/hookscope-test/run"  # no directory can be made under /proc, even by root


class Net(nn.Module):
    """The notebook's model: five modules, an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.act(self.bn(self.conv(x)))).flatten(1))


def _train(model: nn.Module, monitors: list[hs.Monitor], steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(models.images(2, 8)).pow(2).mean().backward()
        opt.step()
        for mon in monitors:
            mon.step()


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in hs.read_log(path) if r["type"] == "step"]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert_no_hooks(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- logs: never corrupted, never silently overwritten ---------------------------------------


def test_a_notebook_cell_run_twice_replaces_its_monitor_and_keeps_both_logs(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = Net()
    first = hs.Monitor(model, every=1, log_dir=tmp_path)  # the cell
    hooked = len(hooks_on(model))
    _train(model, [first], 5)
    second = hs.Monitor(model, every=1, log_dir=tmp_path)  # the same cell, run again
    assert len(hooks_on(model)) == hooked  # replaced, not stacked
    with pytest.raises(hs.HookscopeError, match="replaced it") as exc:
        first.step()
    assert "Fix: call step() on the new Monitor" in str(exc.value)
    _train(model, [second], 3)
    second.close()
    assert_no_hooks(model)
    assert first.log_path == tmp_path / "hookscope.jsonl"
    assert second.log_path == tmp_path / "hookscope-2.jsonl"
    assert _steps(first.log_path) == list(range(5))  # the first run's log, whole
    assert _steps(tmp_path) == _steps(second.log_path) == list(range(3))  # the newest run
    assert b"\0" not in first.log_path.read_bytes() + second.log_path.read_bytes()
    assert hs.report(tmp_path) == tmp_path / "report-2.html"
    assert hs.report(first.log_path) == tmp_path / "report.html"


def test_two_open_monitors_on_one_log_dir_each_write_a_complete_log(tmp_path: Path) -> None:
    torch.manual_seed(0)
    a, b = Net(), models.ResNet(width=4, classes=3)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.01)
    with (
        hs.Monitor(a, every=1, log_dir=tmp_path) as mon_a,
        hs.Monitor(b, every=2, log_dir=tmp_path) as mon_b,
    ):
        for _ in range(4):  # interleaved writes to one directory
            for model, opt, mon in ((a, opt_a, mon_a), (b, opt_b, mon_b)):
                opt.zero_grad()
                model(models.images(2, 8)).pow(2).mean().backward()
                opt.step()
                mon.step()
    assert mon_a.log_path != mon_b.log_path
    for mon, name in ((mon_a, "Net"), (mon_b, "ResNet")):
        records = hs.read_log(mon.log_path)
        assert records[0]["model"] == name
        assert _steps(mon.log_path) == list(range(4))
        assert b"\0" not in mon.log_path.read_bytes()
    if (tmp_path / "tensorboard-2").is_dir():  # tensorboard installed: a run of its own
        assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_a_new_run_in_an_old_runs_directory_leaves_that_run_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = Net()
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        _train(model, [mon], 10)
    old = (tmp_path / "hookscope.jsonl").read_bytes()
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        _train(model, [mon], 2)
    assert (tmp_path / "hookscope.jsonl").read_bytes() == old
    assert _steps(tmp_path / "hookscope.jsonl") == list(range(10))
    assert _steps(tmp_path) == list(range(2))
    assert main(["report", str(tmp_path)]) == 0  # the CLI reads the newest run
    assert capsys.readouterr().out.strip() == str(tmp_path / "report-2.html")


def test_a_binary_file_is_no_log_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "hookscope.jsonl").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(hs.HookscopeError, match="not a hookscope log: it is not UTF-8 text"):
        hs.read_log(tmp_path)
    with pytest.raises(hs.HookscopeError, match="not UTF-8"):
        hs.report(tmp_path)


WATCHED = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({steps}):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
open({marker!r}, "w").write("ran")
"""


def test_watch_run_twice_into_one_out_keeps_the_first_runs_log_and_report(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    for steps in (6, 3):
        script = tmp_path / f"train{steps}.py"
        script.write_text(WATCHED.format(steps=steps, marker=str(tmp_path / "ran")))
        assert (
            main(["watch", "--out", str(out), "--every", "1", "--", sys.executable, str(script)])
            == 0
        )
    err = capfd.readouterr().err
    assert "Sequential: 6 steps, 0 findings -> report:" in err
    assert "Sequential: 3 steps, 0 findings -> report:" in err and "report-2.html" in err
    assert _steps(out / "hookscope.jsonl") == list(range(6))
    assert _steps(out / "hookscope-2.jsonl") == list(range(3))
    assert (out / "report.html").is_file() and (out / "report-2.html").is_file()


OWN_MONITOR = """
import torch, torch.nn as nn, hookscope as hs
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
{before}
with hs.Monitor(model, every=1, log_dir={log!r}) as mon:
    {after}
    for step in range(5):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step(); mon.step()
print("own", len([r for r in mon.records if r["type"] == "step"]))
"""


@pytest.mark.parametrize("optimizer", ["after", "before"])  # made after or before its Monitor
def test_watch_leaves_a_model_the_script_monitors_itself_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], optimizer: str
) -> None:
    make = "opt = torch.optim.SGD(model.parameters(), lr=0.1)"
    script = tmp_path / "own.py"
    script.write_text(
        OWN_MONITOR.format(
            log=str(tmp_path / "own"),
            before=make if optimizer == "before" else "",
            after=make if optimizer == "after" else "pass",
        )
    )
    assert main(["watch", "--out", str(tmp_path / "out"), "--", sys.executable, str(script)]) == 0
    out, err = capfd.readouterr()
    assert out == "own 5\n", err
    assert "the script watches it with its own hs.Monitor" in err
    assert "Traceback" not in err and "HookscopeError" not in err
    assert _steps(tmp_path / "own") == list(range(5))


# -- output paths that cannot be written -----------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_an_unwritable_log_dir_is_refused_and_the_model_left_as_it_was(
    tmp_path: Path, where: str
) -> None:
    (tmp_path / "a_file").write_text("x")
    log_dir = UNWRITABLE if where == "proc" else str(tmp_path / "a_file" / "run")
    model = Net()
    before = _state(model)
    with pytest.raises(hs.HookscopeError, match="cannot write the log") as exc:
        hs.Monitor(model, log_dir=log_dir)
    assert "Fix:" in str(exc.value) and "log_dir=" in str(exc.value)
    _unchanged(model, before)


def test_watch_with_an_unwritable_out_stops_before_the_command_runs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(WATCHED.format(steps=2, marker=str(tmp_path / "ran")))
    status = main(["watch", "--out", UNWRITABLE, "--", sys.executable, str(script)])
    err = capfd.readouterr().err
    assert status == 1
    assert f"Error: cannot write the logs at {UNWRITABLE!r}" in err and "--out" in err
    assert "Try 'hookscope watch --help'" in err
    assert not (tmp_path / "ran").exists()  # not run unwatched


def test_watch_checks_out_without_leaving_a_directory_behind(tmp_path: Path) -> None:
    script = tmp_path / "quiet.py"
    script.write_text("print('no training')\n")
    out = tmp_path / "a" / "b" / "out"
    assert main(["watch", "--out", str(out), "--", sys.executable, str(script)]) == 0
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--out", UNWRITABLE, "--epochs", "1"], "cannot write the demo's log"),
        (["report", "RUN", "--out", UNWRITABLE + "/r.html"], "cannot write the report"),
        (["replay", "nobundle", "--model", "torch.nn:Linear"], "no replay bundle at 'nobundle'"),
        (["summary", "torch.nn:Linear", "--input", "2,3"], "torch.nn:Linear() failed: TypeError"),
    ],
)
def test_cli_errors_are_one_line_not_a_traceback(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    if argv[0] == "report":  # a real run to report on
        model = Net()
        with hs.Monitor(model, every=1, log_dir=tmp_path / "run") as mon:
            _train(model, [mon], 1)
        argv = [a.replace("RUN", str(tmp_path / "run")) for a in argv]
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert err.startswith("Error: ") and message in err and "Traceback" not in err
    assert f"Try 'hookscope {argv[0]} --help'" in err


def test_replay_checks_the_bundle_before_building_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "factory_bad.py").write_text(
        "import pathlib\n"
        "def build():\n"
        f"    pathlib.Path({str(tmp_path / 'built')!r}).touch()\n"
        "    raise RuntimeError('a factory that needs a GPU')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "factory_bad", raising=False)
    assert main(["replay", str(tmp_path / "nobundle"), "--model", "factory_bad:build"]) == 1
    assert "no replay bundle" in capfd.readouterr().err
    assert not (tmp_path / "built").exists()


# -- models no hook can watch ----------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _verbs(model, x):
    return {
        "capture": lambda: hs.capture(model, "0").__enter__(),
        "extract": lambda: hs.extract(model, x, where="0"),
        "intervene": lambda: hs.intervene(model, "0", lambda v, site: v).__enter__(),
        "summary": lambda: hs.summary(model, x),
        "Monitor": lambda: hs.Monitor(model),
        "select": lambda: hs.select(model, "0"),
    }


def _torchscript(kind: str, model: nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; users still have it
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(model) if kind == "script" else torch.jit.trace(model, x)


@pytest.mark.parametrize("kind", ["script", "trace"])
@pytest.mark.parametrize(
    "verb", ["capture", "extract", "intervene", "summary", "Monitor", "select"]
)
def test_a_torchscript_model_is_refused_naming_the_eager_model(kind: str, verb: str) -> None:
    eager, x = _mlp(), torch.randn(4, 8)
    scripted = _torchscript(kind, eager, x)
    with pytest.raises(hs.UnsupportedModelError, match="TorchScript module") as exc:
        _verbs(scripted, x)[verb]()
    assert "Fix: pass the eager model" in str(exc.value)
    assert isinstance(exc.value, TypeError)
    assert_no_hooks(eager)


def test_a_traced_part_of_a_python_model_is_refused_only_when_chosen() -> None:
    x = torch.randn(4, 8)
    model = nn.Sequential(_torchscript("trace", _mlp(), x), nn.Tanh())
    with pytest.raises(hs.UnsupportedModelError, match="'0' is a TorchScript module"):
        hs.capture(model, "0")
    with hs.capture(model, "1") as cap:  # the Python module after it: fine
        y = model(x)
    torch.testing.assert_close(cap["1"].output, y)


@pytest.mark.parametrize(
    "verb", ["capture", "extract", "intervene", "summary", "Monitor", "select"]
)
def test_a_plain_function_is_refused_naming_the_fix(verb: str) -> None:
    def double(t: torch.Tensor) -> torch.Tensor:
        return 2 * t

    with pytest.raises(hs.UnsupportedModelError, match="expected a torch.nn.Module") as exc:
        _verbs(double, torch.randn(4, 8))[verb]()
    assert "'double'" in str(exc.value) and "Fix: pass the model" in str(exc.value)


def test_a_meta_device_monitor_is_refused_and_capture_still_gives_shapes() -> None:
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(hs.HookscopeError, match="meta device") as exc:
        hs.Monitor(model)
    assert "to_empty" in str(exc.value)
    assert_no_hooks(model)
    with hs.capture(model, "0") as cap:
        model(torch.randn(4, 8, device="meta"))
    assert cap["0"].output.shape == (4, 16) and cap["0"].output.is_meta


# -- mon.step() with nothing to close, or on a closed Monitor --------------------------------


def test_step_with_no_forward_warns_once_and_step_after_close_is_an_error() -> None:
    model = _mlp()
    with hs.Monitor(model, every=1) as mon:
        with pytest.warns(hs.HookscopeWarning, match="nothing of Sequential ran"):
            mon.step()
        mon.step()  # said once
        model(torch.randn(2, 8)).sum().backward()
        mon.step()  # a real step: quiet
    with pytest.raises(hs.HookscopeError, match="this Monitor is closed after 3 steps") as exc:
        mon.step()
    assert "Fix: make a new Monitor" in str(exc.value)
    assert [r["step"] for r in mon.records if r["type"] == "step"] == [0, 1, 2]
    assert_no_hooks(model)


# -- a module that returns a generator -------------------------------------------------------


class Pieces(nn.Module):
    def forward(self, x: torch.Tensor):
        return (x * k for k in range(3))


class Joined(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pieces, self.fc = Pieces(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.fc(p) for p in self.pieces(x)])


def test_capturing_a_generator_output_is_an_error_and_other_modules_still_capture() -> None:
    model, x = Joined(), torch.randn(2, 8)
    with pytest.raises(hs.HookscopeError, match="a generator is among the values of 'pieces'"):
        with hs.capture(model, "pieces"):
            model(x)
    assert_no_hooks(model)
    with hs.capture(model, "fc") as cap:
        y = model(x)
    assert len(cap.all("fc")) == 3 and torch.equal(cap.all("fc")[2].output, y[2])
    with hs.Monitor(model, every=1) as mon:  # the Monitor passes it by
        model(x).sum().backward()
        mon.step()
    assert mon.findings == []


# -- extract_dataset -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "a_file"])
def test_extract_dataset_to_an_unwritable_out_is_refused(tmp_path: Path, where: str) -> None:
    (tmp_path / "a_file").write_text("x")
    out = UNWRITABLE if where == "proc" else tmp_path / "a_file"
    with pytest.raises(hs.HookscopeError, match="out=") as exc:
        hs.extract_dataset(_mlp(), [torch.randn(4, 8)], "0", out, progress=False)
    assert "Fix:" in str(exc.value)


def test_extract_dataset_over_strings_says_a_batch_holds_no_tensor(tmp_path: Path) -> None:
    with pytest.raises(hs.HookscopeError, match="batch 0 of the loader holds no tensor") as exc:
        hs.extract_dataset(_mlp(), ["a cat", "a dog"], "0", tmp_path / "f", progress=False)
    assert "tokenize" in str(exc.value) and isinstance(exc.value.__cause__, TypeError)


class Rows(Dataset):
    """Rows that depend on their index only; Ctrl-C while fetching row ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.stop_at:
            raise KeyboardInterrupt
        return torch.full((8,), float(i)).sin()


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# Shards of 4 batches of 10 rows: Ctrl-C in shard 0's second batch, in shard 1's first (shard 0
# full), in shard 1's last (3 batches computed); shuffled: wherever row 12 lands.
@pytest.mark.parametrize(
    ("stop_at", "shuffle"), [(12, False), (45, False), (75, False), (12, True)]
)
def test_extract_dataset_resumed_after_ctrl_c_ends_with_the_same_files(
    tmp_path: Path, stop_at: int, shuffle: bool
) -> None:
    model = _mlp()

    def run(out: Path, data: Rows) -> hs.FeatureStore:
        order = torch.Generator().manual_seed(0)
        loader = DataLoader(data, batch_size=10, shuffle=shuffle, generator=order)
        return hs.extract_dataset(model, loader, "0", out, shard_rows=40, progress=False)

    fresh = run(tmp_path / "fresh", Rows())
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", Rows(stop_at=stop_at))
    resumed = run(tmp_path / "resumed", Rows())
    assert resumed.complete and _files(tmp_path / "resumed") == _files(tmp_path / "fresh")
    assert torch.equal(resumed["0"][:], fresh["0"][:])


def test_extract_dataset_keeps_a_full_shard_when_interrupted(tmp_path: Path) -> None:
    loader = DataLoader(Rows(stop_at=40), batch_size=10)  # Ctrl-C right after shard 0 filled
    with pytest.raises(KeyboardInterrupt):
        hs.extract_dataset(_mlp(), loader, "0", tmp_path, shard_rows=40, progress=False)
    ledger = [
        json.loads(line) for line in (tmp_path / "rank0.ledger.jsonl").read_text().splitlines()
    ]
    assert [e["batches"] for e in ledger] == [[0, 4]]


# -- intervene ---------------------------------------------------------------------------------


def test_an_edit_that_does_not_take_value_and_site_is_refused_before_any_hook() -> None:
    model = _mlp()
    before = _state(model)
    with pytest.raises(TypeError, match=r"<lambda>\(out\), cannot be called as fn\(value, site\)"):
        hs.intervene(model, "0", lambda out: out * 0)
    _unchanged(model, before)
    x = torch.randn(2, 8)
    with hs.intervene(model, "1", lambda *args: None):  # *args takes both: accepted
        y = model(x)
    torch.testing.assert_close(y, model(x))
