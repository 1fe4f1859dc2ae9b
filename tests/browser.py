"""A page opened in headless Chromium through the DevTools protocol, for report.html's test.

The protocol runs over ``--remote-debugging-pipe`` (JSON messages ending in NUL on file
descriptors 3 and 4), so no websocket library is needed. What the test wants from the browser:
every request the page made, every console error or uncaught exception, values the page's
script computes, and a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Page", "chromium", "close", "open_page"]


def chromium() -> str | None:
    """Debian's ``chromium`` (CI installs it with apt-get), or another Chromium on PATH."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@dataclass
class Page:
    """One loaded page; ``requests`` and ``errors`` fill up as the page works."""

    proc: subprocess.Popen[bytes]
    to_browser: int
    from_browser: int
    profile: str
    session: str = ""
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _buffer: bytes = b""
    _next_id: int = 0

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def wait_for(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            message = self._read(timeout)
            if message.get("method") == event:
                return message

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when a promise)."""
        reply = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("the browser did not answer")
            ready, _, _ = select.select([self.from_browser], [], [], deadline - time.monotonic())
            if not ready:
                continue  # the deadline check above raises
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        self._observe(message)
        return message

    def _observe(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params["exceptionDetails"])[:500])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(json.dumps(params.get("args"))[:500])
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            # Content-Security-Policy refusals and failed loads are reported here.
            self.errors.append(params["entry"].get("text", ""))


def open_page(browser: str, url: str, width: int = 1280, height: int = 1000) -> Page:
    """Start the browser, open ``url`` with network, console and log events recorded, and
    return once the page has loaded. Close it with ``close(page)``."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # Above 9, so that moving one end to fd 3 or 4 cannot close the other.
    to_browser_r, from_browser_w = (_high(fd) for fd in (to_browser_r, from_browser_w))
    profile = tempfile.mkdtemp(prefix="onnx-bisect-chromium-")
    args = [
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace to sandbox with
        "--disable-gpu",
        "--no-first-run",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",  # not the user's profile, and nothing left behind
        f"--window-size={width},{height}",
        "about:blank",
    ]
    # The browser reads commands on fd 3 and writes on fd 4; bash moves the pipes there (dash
    # takes one-digit fds only).
    a, b = to_browser_r, from_browser_w
    proc = subprocess.Popen(
        ["bash", "-c", f'exec "$0" "$@" 3<&{a} 4>&{b} {a}<&- {b}>&-', browser, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(a, b),
    )
    os.close(to_browser_r)
    os.close(from_browser_w)
    page = Page(proc, to_browser_w, from_browser_r, profile)
    try:
        _load(page, url, width, height)
    except BaseException:
        close(page)
        raise
    return page


def _load(page: Page, url: str, width: int, height: int) -> None:
    target = page.call("Target.createTarget", url="about:blank")["targetId"]
    page.session = page.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Network", "Runtime", "Log", "Page"):
        page.call(f"{domain}.enable")
    page.call(
        "Emulation.setDeviceMetricsOverride",
        width=width,
        height=height,
        deviceScaleFactor=1,
        mobile=False,
    )
    page.call("Page.navigate", url=url)
    page.wait_for("Page.loadEventFired")


def _high(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def close(page: Page) -> None:
    with contextlib.suppress(RuntimeError, TimeoutError, OSError):
        page.call("Browser.close", timeout=10)
    try:
        page.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        page.proc.kill()
        page.proc.wait()
    os.close(page.to_browser)
    os.close(page.from_browser)
    shutil.rmtree(page.profile, ignore_errors=True)
