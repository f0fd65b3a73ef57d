"""A headless Chromium driven over the DevTools protocol (a WebSocket of its own, with the `websockets` client
library), for tests of the pages the server serves. No browser-automation package: the protocol's few calls
these tests need are below."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """A Chromium-family binary: $LEGATO_CHROMIUM, else the first of BROWSERS on the PATH."""
    given = os.environ.get("LEGATO_CHROMIUM")
    if given:
        return given
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class Browser:
    """`async with Browser(binary) as b: page = await b.open(url)`; every wait has a deadline."""

    def __init__(self, binary: str, timeout_s: float = 60.0) -> None:
        self.binary, self.timeout_s = binary, timeout_s
        self._ids = iter(range(1, 1 << 30))

    async def __aenter__(self) -> Browser:
        from websockets.asyncio.client import connect

        self._profile = tempfile.mkdtemp(prefix="legato-chromium-")
        self.proc = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}",
             "--autoplay-policy=no-user-gesture-required", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        url = await asyncio.to_thread(self._devtools_url)
        self.ws = await connect(url, max_size=None, open_timeout=self.timeout_s)
        return self

    def _devtools_url(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line.strip())
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
        raise RuntimeError(f"chromium did not start its DevTools endpoint: {seen[-5:]}")

    async def __aexit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        # The whole process group: Chromium's helper processes outlive its main one for a moment and kept
        # writing into the profile while it was being removed ("Directory not empty", 1 run in ~10).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait, 10)
        await asyncio.to_thread(self._remove_profile)

    def _remove_profile(self, deadline_s: float = 10.0) -> None:
        """Removes the profile, retrying while a straggling helper process still writes into it (bounded)."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                shutil.rmtree(self._profile)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    shutil.rmtree(self._profile, ignore_errors=True)
                    return
                time.sleep(0.05)

    async def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        msg_id = next(self._ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.send(json.dumps(msg))
        async with asyncio.timeout(self.timeout_s):
            while True:
                reply = json.loads(await self.ws.recv())
                if reply.get("id") == msg_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})

    async def open(self, url: str) -> Page:
        target = (await self.call("Target.createTarget", {"url": url}))["targetId"]
        session = (await self.call("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        return Page(self, session)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    async def eval(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = await self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                              "awaitPromise": True}, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, what: str, timeout_s: float = 60.0, poll_s: float = 0.05):
        """Polls `expression` until it is truthy (its value is returned); raises TimeoutError past the deadline."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                value = await self.eval(expression)
            except RuntimeError as e:  # the page is between documents (its first load): its context is gone
                last = e
            else:
                if value:
                    return value
                last = value
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"{what}: not within {timeout_s} s (last: {last!r})")
