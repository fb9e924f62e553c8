"""A headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
the browser reads commands on fd 3 and writes replies and events on fd 4, each message one JSON
object ended by a NUL byte). Standard library only; Debian's `chromium` package (installed by
`make system-deps`) is the browser."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM = os.environ.get("FUSECLI_CHROMIUM", "chromium")


def chromium_path() -> str | None:
    return shutil.which(CHROMIUM)


def _high(fd: int) -> int:
    """``fd`` moved to a descriptor number of 10 or more (the old one closed)."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return new


class Browser:
    """One headless browser with one page; events are kept in ``events`` (method, params)."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 60.0):
        path = chromium_path()
        if path is None:
            raise RuntimeError(f"{CHROMIUM} not found: `make system-deps` installs Debian's "
                               "chromium package")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="fusecli-chromium-")
        # the child's ends are moved above fd 9 first, so that neither is 3 or 4 (which the
        # redirections below would overwrite before using)
        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()
        to_child_r, from_child_w = (_high(fd) for fd in (to_child_r, from_child_w))
        args = [path, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--mute-audio",
                "--disable-dev-shm-usage", f"--window-size={width},{height}", "about:blank"]
        # the browser's fd 3 reads our commands, its fd 4 writes to us
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_child_r} 4>&{from_child_w}', "chromium", *args],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[tuple[str, dict]] = []
        self.session = None
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"],
                                 flatten=True, session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    # -- protocol --------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"chromium closed the pipe: {err}")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, session: bool = True, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append((reply["method"], reply.get("params", {})))

    def wait_event(self, method: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        seen = len(self.events)
        for name, params in self.events[:seen]:
            if name == method:
                return params
        while True:
            reply = self._read_message(deadline)
            if "method" in reply:
                self.events.append((reply["method"], reply.get("params", {})))
                if reply["method"] == method:
                    return reply.get("params", {})

    # -- page ------------------------------------------------------------------------------
    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        """The JSON value of ``expression`` evaluated in the page (exceptions raise)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def type_text(self, text: str) -> None:
        self.call("Input.insertText", text=text)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and log entries of level error."""
        out = []
        for name, p in self.events:
            if name == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails']}")
            elif name == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning",
                                                                          "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif name == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                out.append(f"log: {p['entry'].get('text')}")
        return out

    def requests(self) -> list[str]:
        return [p["request"]["url"] for name, p in self.events
                if name == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
