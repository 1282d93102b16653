"""Headless Chromium for gui-rl: one browser per episode at a time, pooled, with no network.

Each ``Browser`` is Debian's ``chromium`` driven through ``chromium-driver`` by Selenium, both by
explicit path: the driver is a ``Service`` with its executable given and the binary is
``options.binary_location``, so Selenium Manager (which would download a driver) is never asked;
``SE_OFFLINE=true`` makes it refuse to download should anything call it anyway.
``MINIWOB_CHROME_BINARY`` / ``MINIWOB_CHROMEDRIVER`` name other binaries (miniwob's own names for
them); they default to the Debian paths on PATH.

No network: task pages are local ``file://`` pages. Every request the browser would send over the
network goes to a proxy at ``127.0.0.1:9`` (the discard port: nothing listens, so it is refused at
once), ``<-loopback>`` takes loopback addresses off the proxy's default bypass list so that the
host's own ports are no exception, and ``--host-resolver-rules`` makes every name fail to resolve.
``file://`` pages do not use the proxy, so the tasks still load.

``BrowserPool`` hands out at most ``size`` browsers, reuses healthy ones across episodes, and
replaces one that crashed or hung (its whole process tree is killed) with a fresh one, so a dead
browser costs its episode a restart, never the run.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
from typing import Optional

import psutil

from clawrl.envs.base import EnvError

log = logging.getLogger(__name__)

CHROME_ENV, DRIVER_ENV = "MINIWOB_CHROME_BINARY", "MINIWOB_CHROMEDRIVER"
DEAD_PROXY = "127.0.0.1:9"
# The window: MiniWoB's task area is 160 x 210 at the top left; room around it for popups.
WINDOW = (500, 400)
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--disable-extensions", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-default-apps", "--mute-audio", f"--window-size={WINDOW[0]},{WINDOW[1]}",
    f"--proxy-server={DEAD_PROXY}", "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND",
)
# Seconds one WebDriver command may take before the browser counts as hung.
COMMAND_TIMEOUT_S = 30


def binaries() -> tuple[str, str]:
    """(chromium, chromedriver) paths: the MINIWOB_* variables, else Debian's on PATH; EnvError
    saying what to install when either is missing."""
    chrome = os.environ.get(CHROME_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get(DRIVER_ENV) or shutil.which("chromedriver")
    if not chrome or not driver:
        raise EnvError("gui-rl needs Chromium and its driver: apt-get install chromium chromium-driver "
                       f"(or set {CHROME_ENV} and {DRIVER_ENV})")
    for path in (chrome, driver):
        if not os.access(path, os.X_OK):
            raise EnvError(f"{path} is not an executable file")
    return chrome, driver


class Browser:
    """One headless Chromium and its driver process."""

    def __init__(self):
        # imported here, not at the top: importing clawrl.envs must not need selenium (screen.py says why)
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service

        chrome, driver = binaries()
        os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should anything reach it: never download
        options = webdriver.ChromeOptions()
        options.binary_location = chrome
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        self.service = Service(executable_path=driver)
        try:
            self.driver = webdriver.Chrome(service=self.service, options=options)
        except WebDriverException as e:
            self.kill()
            raise EnvError(f"Chromium did not start: {str(e).splitlines()[0]}") from None
        self.driver.command_executor.client_config.timeout = COMMAND_TIMEOUT_S
        # --window-size sizes the window, toolbar space included: grow it until the page itself
        # (the viewport every click and bounding box is in) is WINDOW.
        inner = self.driver.execute_script("return [window.innerWidth, window.innerHeight];")
        if tuple(inner) != WINDOW:
            self.driver.set_window_size(2 * WINDOW[0] - inner[0], 2 * WINDOW[1] - inner[1])
            inner = self.driver.execute_script("return [window.innerWidth, window.innerHeight];")
        if tuple(inner) != WINDOW:
            self.kill()
            raise EnvError(f"Chromium's page is {inner[0]} x {inner[1]} pixels, not {WINDOW[0]} x {WINDOW[1]}")
        self.driver.set_script_timeout(COMMAND_TIMEOUT_S)
        self.driver.set_page_load_timeout(COMMAND_TIMEOUT_S)

    def pids(self) -> list[int]:
        """The driver's pid and every descendant's (the browser and its helpers)."""
        process = getattr(self.service, "process", None)
        if process is None:
            return []
        try:
            root = psutil.Process(process.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def browser_pids(self) -> list[int]:
        """The Chromium processes (the driver's children)."""
        return self.pids()[1:]

    def alive(self) -> bool:
        try:
            return self.driver.execute_script("return 1;") == 1
        except Exception:
            return False

    def kill(self) -> None:
        """End the browser and its driver for good: SIGKILL to the whole tree, which also ends a
        hung command waiting on it."""
        for pid in reversed(self.pids()):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        process = getattr(self.service, "process", None)
        if process is not None:
            try:
                process.wait(5)
            except Exception:
                pass

    def close(self) -> None:
        try:
            self.driver.quit()
        except Exception:
            pass
        self.kill()


class BrowserPool:
    """At most ``size`` browsers in use at once; idle healthy ones are kept for the next episode.
    Thread-safe and free of any event loop (environments call it from worker threads)."""

    def __init__(self, size: int):
        self.size = size
        self.slots = threading.BoundedSemaphore(size)
        self.idle: list[Browser] = []
        self.lock = threading.Lock()
        self.started = self.replaced = 0

    def acquire(self, wait: bool = True) -> Optional[Browser]:
        """A live browser (an idle one that still answers, else a new one); while all ``size`` are
        in use, blocks, or returns None at once when not ``wait``."""
        if not self.slots.acquire(blocking=wait):
            return None
        try:
            while True:
                with self.lock:
                    browser = self.idle.pop() if self.idle else None
                if browser is None:
                    browser = Browser()
                    with self.lock:
                        self.started += 1
                    return browser
                if browser.alive():
                    return browser
                log.warning("gui: an idle browser stopped answering; replacing it")
                browser.close()
                with self.lock:
                    self.replaced += 1
        except BaseException:
            self.slots.release()
            raise

    def release(self, browser: Browser, healthy: bool = True) -> None:
        """Give ``browser`` back: kept for reuse when ``healthy``, else killed (the next acquire
        starts a fresh one)."""
        try:
            if healthy:
                with self.lock:
                    self.idle.append(browser)
            else:
                browser.close()
                with self.lock:
                    self.replaced += 1
        finally:
            self.slots.release()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for browser in idle:
            browser.close()


_POOLS: dict[int, BrowserPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(size: int) -> BrowserPool:
    """The process's pool of ``size`` browsers (one per size asked for), closed at exit."""
    with _POOLS_LOCK:
        if size not in _POOLS:
            _POOLS[size] = BrowserPool(size)
        return _POOLS[size]


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
