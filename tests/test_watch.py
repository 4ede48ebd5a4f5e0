"""`hookscope watch -- COMMAND`: unmodified scripts run as subprocesses, watched from outside.

Each test writes a small training script to ``tmp_path`` and runs it under ``watch``: in this
process through ``main([...])`` (the child still is a fresh interpreter), or as a separate
``hookscope`` process where a signal must reach the parent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _gloo import teardown_abort
from hookscope._cli import main
from hookscope._watch import BOOT

# A small classifier trained for STEPS steps; FAULT lines are spliced into the loop.
TRAIN = """
import os, sys, time
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for step in range({steps}):
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
{fault}
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", {steps}, "steps")
"""


def _script(tmp_path: Path, steps: int = 12, fault: str = "", name: str = "train.py") -> Path:
    path = tmp_path / name
    body = textwrap.indent(textwrap.dedent(fault).strip(), "    ") if fault else ""
    path.write_text(TRAIN.format(steps=steps, fault=body), encoding="utf-8")
    return path


def _records(log_dir: Path, kind: str) -> list[dict]:
    lines = (log_dir / "hookscope.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def _watch(tmp_path: Path, *command: str, options: tuple[str, ...] = ()) -> int:
    return main(["watch", "--out", str(tmp_path / "out"), *options, "--", *command])


# -- one script, start to end ----------------------------------------------------------------


def test_watch_logs_every_step_and_leaves_the_output_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "out" / "Old" / "hookscope.jsonl"  # an earlier run's: not reported
    stale.parent.mkdir(parents=True)
    stale.write_text('{"type": "header", "model": "Old"}\n')
    script = _script(tmp_path, steps=12)
    assert _watch(tmp_path, sys.executable, str(script), options=("--every", "5")) == 0
    out, err = capfd.readouterr()
    assert out == "trained 12 steps\n"  # the script's stdout, and nothing else
    steps = _records(tmp_path / "out", "step")
    assert [s["step"] for s in steps] == list(range(12))
    assert [s["step"] for s in steps if s["sampled"]] == [0, 5, 10]
    assert set(steps[5]["act"]) == {"fc1", "act", "fc2"}
    assert all("loss" in s["scalars"] for s in steps)  # step 0's forward watched too
    assert (tmp_path / "out" / "report.html").is_file()
    assert "[hookscope] watching Net (3 modules)" in err
    assert "Net: 12 steps, 0 findings -> report:" in err
    assert "Old" not in err and not (stale.parent / "report.html").exists()


def test_a_crash_keeps_its_exit_status_and_its_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, fault="if step == 7: raise RuntimeError('boom')")
    assert _watch(tmp_path, sys.executable, str(script)) == 1
    err = capfd.readouterr().err
    assert "RuntimeError: boom" in err and "the command exited with 1" in err
    assert [s["step"] for s in _records(tmp_path / "out", "step")] == list(range(7))
    assert (tmp_path / "out" / "report.html").is_file()


def test_a_nan_is_found(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, fault="if step == 6: x[0, 0] = float('nan')")
    assert _watch(tmp_path, sys.executable, str(script)) == 0
    findings = _records(tmp_path / "out", "finding")
    assert [(f["kind"], f["step"], f["module"]) for f in findings][:1] == [("nonfinite", 6, "fc1")]
    assert "Net step 6: nonfinite in fc1" in capfd.readouterr().err


def test_on_nonfinite_raise_stops_the_script(tmp_path: Path) -> None:
    script = _script(tmp_path, fault="if step == 6: x[0, 0] = float('nan')")
    code = _watch(tmp_path, sys.executable, str(script), options=("--on-nonfinite", "raise"))
    assert code == 1
    steps = _records(tmp_path / "out", "step")
    assert [s["step"] for s in steps] == list(range(6))  # raised before step 6's update


# A NaN made in step 0's forward: the step where watch attaches.
FIRST_STEP = """
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)
        self.poison = False

    def forward(self, x):
        h = self.fc1(x)
        if self.poison:
            h = torch.log(h - 100.0)  # <- log
        return self.fc2(self.act(h))

torch.manual_seed(0)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(5):
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    model.poison = step == 0
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("finite", all(bool(p.isfinite().all()) for p in model.parameters()))
"""


@pytest.mark.parametrize(("mode", "finite"), [("log", False), ("skip", True)])
def test_a_nan_at_the_first_step_is_found_before_its_update_with_its_op(
    tmp_path: Path, mode: str, finite: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "first.py"
    script.write_text(FIRST_STEP)
    assert _watch(tmp_path, sys.executable, str(script), options=("--on-nonfinite", mode)) == 0
    out, err = capfd.readouterr()
    assert out == f"finite {finite}\n"  # skip: step 0's update never reached the weights
    findings = _records(tmp_path / "out", "finding")
    first = findings[0]
    line = next(i + 1 for i, text in enumerate(FIRST_STEP.splitlines()) if "# <- log" in text)
    # the log is in Net.forward itself, between its children: Net ("") is blamed
    assert (first["kind"], first["step"], first["module"]) == ("nonfinite", 0, "")
    assert (first["op"], first["source"]) == ("aten.log", f"{script}:{line}")
    assert "Net step 0: nonfinite in the model" in err
    skipped = [e for e in _records(tmp_path / "out", "event") if e["kind"] == "skipped_step"]
    assert [e["step"] for e in skipped] == ([0] if mode == "skip" else [])


def test_an_optimizer_made_before_the_start_up_hook_is_still_watched(tmp_path: Path) -> None:
    # Optimizer.__init__ unwrapped again, as if the optimizer came before the start-up hook:
    # the model is found at its first step, and every step is logged.
    script = _script(tmp_path, steps=6)
    text = script.read_text().replace(
        "opt = torch.optim.SGD(",
        "import _hookscope_boot\n"
        "torch.optim.Optimizer.__init__ = torch.optim.Optimizer.__init__.__wrapped__\n"
        "opt = torch.optim.SGD(",
    )
    script.write_text(text)
    assert _watch(tmp_path, sys.executable, str(script), options=("--every", "1")) == 0
    steps = _records(tmp_path / "out", "step")
    assert [s["step"] for s in steps] == list(range(6))
    assert steps[0]["param"] and "loss" not in steps[0]["scalars"]  # step 0 seen from its end
    assert all("loss" in s["scalars"] for s in steps[1:])


def test_a_process_that_never_steps_imports_nothing_and_writes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    probe = "import sys; print(sorted(m for m in sys.modules if 'torch' in m or 'hookscope' in m))"
    assert _watch(tmp_path, sys.executable, "-c", probe) == 0
    out, err = capfd.readouterr()
    assert out == "['_hookscope_boot']\n"  # the start-up hook alone: no torch, no hookscope
    assert "nothing to report: no model was watched" in err
    assert not (tmp_path / "out").exists()


def test_a_process_that_only_runs_forward_passes_imports_no_hookscope(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # torch imported and a model run (inference): the backward trampoline never fires.
    probe = (
        "import sys, torch; torch.nn.Linear(4, 2)(torch.randn(3, 4)).sum(); "
        "print(any(m.split('.')[0] == 'hookscope' for m in sys.modules))"
    )
    assert _watch(tmp_path, sys.executable, "-c", probe) == 0
    out, err = capfd.readouterr()
    assert out == "False\n"
    assert "nothing to report: no model was watched" in err


# Plain SGD by hand, as PyTorch's word_language_model example trains: no torch.optim at all.
BY_HAND = """
import torch, torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)
        self.poison = False

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.poison:
            h = torch.log(h - 1.0)  # <- log
        return self.fc2(h)

torch.manual_seed(0)
model = Net()
losses = []
for step in range(8):
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    model.poison = step == {bad}
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
    losses.append(loss.item())
    if step == 3:
        with torch.no_grad():
            model.eval(); model(torch.randn(4, 8)); model.train()  # evaluation: no step
print(" ".join(f"{{l:.6f}}" for l in losses))
"""


@pytest.mark.parametrize("bad", [-1, 5])
def test_a_model_trained_by_hand_is_watched_a_step_per_forward_and_backward(
    tmp_path: Path, bad: int, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "by_hand.py"
    script.write_text(BY_HAND.format(bad=bad))
    assert _watch(tmp_path, sys.executable, str(script), options=("--every", "1")) == 0
    out, err = capfd.readouterr()
    losses = [float(v) for v in out.split()]
    steps = _records(tmp_path / "out", "step")
    assert [s["step"] for s in steps] == list(range(8))  # step 0 (found by its backward) too
    finite = bad if bad >= 0 else len(steps)  # the steps before the NaN
    logged = [s["scalars"]["loss"] for s in steps]
    assert logged[:finite] == pytest.approx(losses[:finite])
    assert all(s["param"]["fc1.weight"]["grad_norm"] > 0 for s in steps[:finite])
    assert set(steps[1]["act"]) == {"fc1", "act", "fc2"}  # later forwards watched
    assert "[hookscope] watching Net (3 modules)" in err
    findings = _records(tmp_path / "out", "finding")
    if bad < 0:
        assert findings == []
        return
    line = next(i + 1 for i, text in enumerate(BY_HAND.splitlines()) if "# <- log" in text)
    first = findings[0]
    # checked before the script's own update: the replay still sees finite weights
    assert (first["kind"], first["step"], first["op"]) == ("nonfinite", bad, "aten.log")
    assert first["source"] == f"{script}:{line}"


def test_a_model_that_cannot_be_watched_gets_the_whole_message(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, steps=2)
    assert _watch(tmp_path, sys.executable, str(script), options=("--where", "nosuch")) == 0
    err = capfd.readouterr().err
    assert "hookscope watch: not watching Net: No module named 'nosuch' in Net.\n    Hint:" in err
    assert "'fc1', 'act', 'fc2'" in err  # the message's further lines, not only its first


# -- several models and optimizers -------------------------------------------------------------

GAN = """
import torch, torch.nn as nn

class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    def forward(self, z):
        return self.net(z)

class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    def forward(self, x):
        return self.net(x)

torch.manual_seed(0)
G, D = Generator(), Discriminator()
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for step in range(8):
    real, z = torch.randn(16, 8), torch.randn(16, 4)
    fake = G(z)
    d_loss = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = bce(D(fake), torch.ones(16, 1))
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
"""


def test_a_gan_with_two_optimizers_gets_two_logs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "gan.py").write_text(GAN)
    assert _watch(tmp_path, sys.executable, str(tmp_path / "gan.py"), options=("--every", "1")) == 0
    out = tmp_path / "out"
    first, second = out, out / "Discriminator"  # the first optimizer made, then the next
    assert _records(first, "header")[0]["model"] == "Generator"
    assert _records(second, "header")[0]["model"] == "Discriminator"
    for log_dir in (first, second):
        steps = _records(log_dir, "step")
        assert [s["step"] for s in steps] == list(range(8))
        assert steps[3]["param"] and steps[3]["act"]  # a full step: weights and activations
        assert (log_dir / "report.html").is_file()
    err = capfd.readouterr().err
    assert "Discriminator: 8 steps" in err and "Generator: 8 steps" in err


ROUND = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
body = torch.optim.SGD(model[0].parameters(), lr=0.1)
head = torch.optim.Adam(model[2].parameters(), lr=1e-3)
for step in range(6):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    body.zero_grad(); head.zero_grad(); loss.backward()
    body.step(); head.step()
"""


def test_two_optimizers_on_one_model_make_one_step(tmp_path: Path) -> None:
    (tmp_path / "round.py").write_text(ROUND)
    assert (
        _watch(tmp_path, sys.executable, str(tmp_path / "round.py"), options=("--every", "1")) == 0
    )
    steps = _records(tmp_path / "out", "step")
    assert [s["step"] for s in steps] == list(range(6))
    assert set(steps[2]["param"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all("update_ratio" in steps[2]["param"][n] for n in ("0.weight", "2.weight"))
    assert not _records(tmp_path / "out", "event")  # no step looked skipped
    assert not list((tmp_path / "out").glob("*/hookscope.jsonl"))


# -- DataLoader workers, an existing sitecustomize ------------------------------------------------

LOADER = """
import json, os, sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

def report_worker(worker_id):
    with open(os.path.join(os.environ["PROBE_DIR"], f"worker{{os.getpid()}}.json"), "w") as f:
        json.dump({{"boot": "_hookscope_boot" in sys.modules,
                    "hookscope": "hookscope" in sys.modules}}, f)

if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=16, num_workers=2, worker_init_fn=report_worker,
                        {context})
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize(
    "context",
    ["", pytest.param("multiprocessing_context='spawn', persistent_workers=True", id="spawn")],
)
def test_dataloader_workers_stay_silent(
    tmp_path: Path, context: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "loader.py").write_text(LOADER.format(context=context))
    probes = tmp_path / "probes"
    probes.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probes))
    assert _watch(tmp_path, sys.executable, str(tmp_path / "loader.py")) == 0
    assert [s["step"] for s in _records(tmp_path / "out", "step")] == list(range(8))
    workers = [json.loads(p.read_text()) for p in probes.iterdir()]
    assert len(workers) == (2 if context else 4)
    if context:  # spawned: the start-up hook ran, hookscope was never imported
        assert workers == [{"boot": True, "hookscope": False}] * 2
    err = capfd.readouterr().err
    assert "hookscope watch:" not in err  # no warning from any process
    assert err.count("[hookscope] watching") == 1
    assert not list((tmp_path / "out").glob("*/hookscope.jsonl"))


def test_an_existing_sitecustomize_still_runs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    monkeypatch.setenv("PYTHONPATH", str(user))
    script = _script(tmp_path, steps=3)
    script.write_text(
        script.read_text() + "import sitecustomize\nprint(os.environ.get('USER_SITECUSTOMIZE'), "
        "sitecustomize.__file__, sys.path.index(os.path.dirname(sitecustomize.__file__)) > 0)\n"
    )
    assert _watch(tmp_path, sys.executable, str(script)) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[-1] == f"ran {user / 'sitecustomize.py'} True"
    assert len(_records(tmp_path / "out", "step")) == 3


def test_child_env_puts_the_boot_first_once() -> None:
    from hookscope._watch import Settings, child_env

    env = child_env({"PYTHONPATH": f"/a{os.pathsep}/b"}, Settings("/out"))
    assert env["PYTHONPATH"] == os.pathsep.join([str(BOOT), "/a", "/b"])
    again = child_env(env, Settings("/out"))
    assert again["PYTHONPATH"] == env["PYTHONPATH"]
    assert json.loads(again["HOOKSCOPE_WATCH"])["out"] == "/out"


def test_progress_lines_follow_the_log_as_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from hookscope._watch import _Progress

    monkeypatch.chdir(tmp_path.parent)
    log = tmp_path / "hookscope.jsonl"
    stream = io.StringIO()
    progress = _Progress(tmp_path, stream, interval=0.0)
    long = "word " * 80 + "\nFix: the end of a long message."
    lines = [
        {"type": "header", "model": "Net", "modules": {"fc1": "Linear", "fc2": "Linear"}},
        *({"type": "step", "step": i} for i in range(3)),
        {"type": "finding", "step": 2, "kind": "nonfinite", "module": "fc2", "message": "NaN"},
        {"type": "finding", "step": 2, "kind": "dead_units", "module": "", "message": long},
    ]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    log.write_text(text + '{"type": "step", "st')  # a line still being written
    progress.poll()
    assert stream.getvalue().splitlines() == [
        f"[hookscope] watching Net (2 modules) -> {tmp_path.name}",
        "[hookscope] Net step 2: nonfinite in fc2: NaN",
        "[hookscope] Net step 2: dead_units in the model: " + "word " * 80,
        "    Fix: the end of a long message.",  # whole, not cut at 200 characters
        "[hookscope] Net: 3 steps",
    ]
    with log.open("a") as f:
        f.write('ep": 3}\n')
    progress.poll()
    assert stream.getvalue().splitlines()[-1] == "[hookscope] Net: 4 steps"


# -- signals: a separate `hookscope watch` process -------------------------------------------


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_watch_reaches_the_script_and_the_report_is_written(
    tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    script = _script(
        tmp_path,
        steps=100_000,
        fault="""
        if step == 0: open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
        time.sleep(0.02)
        """,
    )
    env = {**os.environ, "PID_FILE": str(tmp_path / "pid")}
    command = [sys.executable, "-m", "hookscope", "watch", "--out", str(tmp_path / "out")]
    parent = subprocess.Popen(
        [*command, "--", sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
    )
    log = tmp_path / "out" / "hookscope.jsonl"
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().count('"type": "step"') >= 5):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail(f"no steps logged: {parent.communicate()[1]}")
        time.sleep(0.1)
    parent.send_signal(sig)
    err = parent.communicate(timeout=60)[1]
    assert parent.returncode == status, err
    assert f"the command was killed by {sig.name}" in err
    steps = _records(tmp_path / "out", "step")  # every line whole
    assert [s["step"] for s in steps] == list(range(len(steps))) and len(steps) >= 5
    assert (tmp_path / "out" / "report.html").is_file()
    with pytest.raises(ProcessLookupError):  # the script is gone, not orphaned
        os.kill(int((tmp_path / "pid").read_text()), 0)


STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a script that ignores SIGTERM
open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_a_second_signal_ends_a_command_that_ignores_the_first(tmp_path: Path) -> None:
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    pid_file = tmp_path / "pid"
    env = {**os.environ, "PID_FILE": str(pid_file)}
    command = [sys.executable, "-m", "hookscope", "watch", "--out", str(tmp_path / "out")]
    parent = subprocess.Popen(
        [*command, "--", sys.executable, str(tmp_path / "stubborn.py")],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail(f"the script did not start: {parent.communicate()[1]}")
        time.sleep(0.1)
    parent.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):  # ignored: it goes on
        parent.wait(timeout=1.0)
    parent.send_signal(signal.SIGTERM)
    err = parent.communicate(timeout=60)[1]
    assert parent.returncode == 143, err
    assert "the command did not end after a second SIGTERM: killed it (SIGKILL)" in err
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


# -- usage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["watch"], ["watch", "--"], ["watch", "--every", "3", "--"]])
def test_watch_without_a_command_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Error: watch needs a command to run after '--'" in err
    assert "Try 'hookscope watch --help' for help." in err


def test_a_command_that_cannot_start_exits_127(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _watch(tmp_path, str(tmp_path / "no-such-program")) == 127
    assert "Error: cannot run" in capsys.readouterr().err


# -- torchrun ----------------------------------------------------------------------------------

DDP = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="no torchrun",
)
def test_torchrun_with_two_processes_gives_one_log_and_one_report(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ddp.py").write_text(DDP)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node", "2", str(tmp_path / "ddp.py")]
    code = _watch(tmp_path, *command, options=("--every", "1"))
    if code != 0 and teardown_abort(capfd.readouterr().err):  # see tests/_gloo.py
        code = _watch(tmp_path, *command, options=("--every", "1"))
    assert code == 0
    out = tmp_path / "out"
    assert [p.relative_to(out) for p in out.rglob("hookscope.jsonl")] == [Path("hookscope.jsonl")]
    headers = _records(out, "header")
    assert len(headers) == 1 and headers[0]["model"] == "Sequential"
    assert [s["step"] for s in _records(out, "step")] == list(range(6))
    assert list(out.rglob("report.html")) == [out / "report.html"]
    assert capfd.readouterr().err.count("[hookscope] watching") == 1
