"""A real headless Chromium driven over the DevTools protocol (``websockets``; no extra test dependency).

``require_chromium()`` fails under ``CI=true`` when Chromium is missing (the report's browser checks
are part of the contract there) and skips elsewhere, saying how to install it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

INSTALL_HINT = "apt-get install -y chromium"


def require_chromium() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"headless Chromium is required for the report tests under CI=true: {INSTALL_HINT}")
        pytest.skip(f"chromium is not installed ({INSTALL_HINT}); these tests FAIL under CI=true")
    return browser


class Browser:
    """One headless Chromium; ``open(url)`` returns a Page with the console errors seen while loading."""

    def __init__(self, binary: str, profile: Path) -> None:
        self.profile = profile
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("headless Chromium did not start (no DevToolsActivePort)")
            time.sleep(0.1)
        self.port = int(port_file.read_text().splitlines()[0])

    def open(self, url: str, timeout: float = 60) -> "Page":
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as resp:
            target = json.loads(resp.read())
        page = Page(target["webSocketDebuggerUrl"])
        page.navigate(url, timeout)
        return page

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)


class Page:
    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=20)
        self._id = 0
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def send(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self._id += 1
        my = self._id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 60) -> dict[str, Any]:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            self.events.append(msg)
            if msg.get("method") == method:
                return msg

    def pump(self, seconds: float) -> None:
        """Collect events for ``seconds`` (lets late console messages arrive)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=max(0.05, deadline - time.monotonic()))))
            except TimeoutError:
                break

    def navigate(self, url: str, timeout: float = 60) -> None:
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired", timeout)
        self.pump(0.5)

    def evaluate(self, expression: str) -> Any:
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def console_errors(self) -> list[str]:
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(p["exceptionDetails"].get("text", "exception"))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out

    def close(self) -> None:
        self.ws.close()
