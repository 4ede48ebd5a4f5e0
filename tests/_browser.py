"""Headless Chromium driven through the DevTools protocol, for the report's browser tests.

The protocol runs over a pipe (``--remote-debugging-pipe``: commands in on fd 3, replies out
on fd 4, each a JSON message ended by a NUL byte), so no port, no websocket and no package
beyond the standard library. The page's console errors, uncaught exceptions and every network
request are recorded while it runs.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)


class Browser:
    """One headless Chromium with one page; ``with Browser(tmp) as b: b.open(path)``."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 900) -> None:
        assert CHROMIUM is not None
        self.size = (width, height)
        to_child, self._out = os.pipe()  # we write commands; chromium reads fd 3
        self._in, from_child = os.pipe()  # chromium writes replies on fd 4
        cmd = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]

        def fds() -> None:  # in the child: the pipe ends where chromium expects them
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            cmd,
            preexec_fn=fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
        )
        os.close(to_child)
        os.close(from_child)
        self._id = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.console_errors: list[str] = []
        self.requests: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # -- the protocol ---------------------------------------------------------------------------
    def _read(self) -> None:
        buf = b""
        with os.fdopen(self._in, "rb", buffering=0) as pipe:
            while True:
                chunk = pipe.read(1 << 16)
                if not chunk:
                    return
                buf += chunk
                while b"\0" in buf:
                    raw, buf = buf.split(b"\0", 1)
                    self._dispatch(json.loads(raw))

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "id" in msg:
            self._replies.setdefault(msg["id"], queue.Queue()).put(msg)
            return
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console_errors.append(
                str(details.get("exception", {}).get("description") or details.get("text"))
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(
                " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.console_errors.append(params["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        self.events.put(msg)

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self._replies.setdefault(self._id, queue.Queue())
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        reply = self._replies[self._id].get(timeout=60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page's session."""
        return self.send(method, self.session, **params)

    # -- what the tests use ---------------------------------------------------------------------
    def open(self, path: Path, timeout: float = 30) -> None:
        """Load a file and wait until its charts are drawn (``html[data-hs-ready]``)."""
        self.call("Page.navigate", url=path.resolve().as_uri())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.eval("document.documentElement?.dataset.hsReady || ''") != "":
                return
            if self.console_errors:
                raise AssertionError(f"page errors: {self.console_errors}")
            time.sleep(0.05)
        raise AssertionError(f"the report did not finish drawing in {timeout} s")

    def eval(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def mouse(self, kind: str, x: float, y: float, **extra: Any) -> None:
        """``kind``: ``mouseMoved``, ``mousePressed``, ``mouseReleased``."""
        self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, **extra)

    def drag(self, x0: float, x1: float, y: float) -> None:
        self.mouse("mouseMoved", x0, y)
        self.mouse("mousePressed", x0, y, button="left", clickCount=1)
        for i in range(1, 6):
            self.mouse("mouseMoved", x0 + (x1 - x0) * i / 5, y, button="left", buttons=1)
        self.mouse("mouseReleased", x1, y, button="left", clickCount=1)

    def screenshot(self, path: Path) -> Path:
        """The whole page (not only the window) as a PNG."""
        height = int(self.eval("document.documentElement.scrollHeight"))
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.size[0],
            height=min(height, 16000),
            deviceScaleFactor=1,
            mobile=False,
        )
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.size[0],
            height=self.size[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._out)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
