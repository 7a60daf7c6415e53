"""Fixtures of the Python binding's tests: a private nats-server on a free loopback port, the C++
peer program, the byte pattern both languages use, and the rule that a test file whose tests
all skipped is reported to ctest as skipped (exit 77), never as passed."""

import os
import queue
import threading
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import ferry

NATS_SERVER = "/usr/sbin/nats-server"


def pattern(size, seed):
    """Byte i is (i * 131 + seed) & 0xff, as ferry_py_peer makes and checks it."""
    import numpy as np

    i = np.arange(size, dtype=np.uint64)
    return ((i * 131 + seed) & 0xFF).astype(np.uint8)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    def __init__(self):
        self.port = _free_port()
        self.url = "nats://127.0.0.1:%d" % self.port
        self._dir = tempfile.mkdtemp(prefix="ferry-py-nats-")
        self.proc = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-l",
             os.path.join(self._dir, "nats.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("nats-server did not start on port %d" % self.port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="module")
def nats():
    if not os.access(NATS_SERVER, os.X_OK):
        pytest.skip("no %s (Debian: nats-server)" % NATS_SERVER)
    server = NatsServer()
    yield server
    server.stop()


def _two_connectors(nats_url):
    a = ferry.Connector("owner", nats=nats_url)
    b = ferry.Connector("peer", nats=nats_url)
    return a, b


@pytest.fixture(scope="module")
def pair():
    """Two connectors of this process without NATS: "owner" and "peer"."""
    a, b = _two_connectors(False)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def nats_pair(nats):
    """The same two on the module's private nats-server."""
    a, b = _two_connectors(nats.url)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def cpp_peer():
    """The path of ferry_py_peer (set by ctest; FERRY_PY_PEER)."""
    path = os.environ.get("FERRY_PY_PEER")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("FERRY_PY_PEER does not name the ferry_py_peer program (run through ctest)")
    return path


class Child:
    """A process speaking the peers' line protocol: "metadata <json>", "ready", "complete".
    A thread reads its stdout into a queue, so that a wait for a line is bounded."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, timeout=30):
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no line from %s within %ss" % (self.proc.args, timeout))
        if line is None:
            self._lines.put(None)
            self.proc.wait(timeout=10)
            raise AssertionError("%s ended (exit %s): %s" % (
                self.proc.args, self.proc.returncode, self.proc.stderr.read()))
        return line

    def expect(self, prefix, timeout=30):
        line = self.line(timeout)
        assert line.startswith(prefix), "expected %r, got %r" % (prefix, line)
        return line[len(prefix):].strip()

    def send(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout=60):
        """Waits for the exit; returns (exit status, the lines not read yet, stderr)."""
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        rest = []
        while True:
            line = self._lines.get_nowait() if not self._lines.empty() else None
            if line is None:
                break
            rest.append(line)
        return self.proc.returncode, "\n".join(rest), self.proc.stderr.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


@pytest.fixture
def children():
    made = []

    def spawn(argv, env=None):
        c = Child(argv, env)
        made.append(c)
        return c

    yield spawn
    for c in made:
        c.kill()


def python_child_env(nats_url=None):
    env = dict(os.environ)
    if nats_url is not None:
        env["FERRY_NATS_URL"] = nats_url
    return env


PY = sys.executable

_outcomes = {"passed": 0, "skipped": 0, "failed": 0}


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _outcomes["passed"] += 1
    elif report.skipped:
        _outcomes["skipped"] += 1
    elif report.failed:
        _outcomes["failed"] += 1


def pytest_sessionfinish(session, exitstatus):
    # ctest counts exit 77 as skipped (SKIP_RETURN_CODE): a file that skipped any test and
    # failed none is reported as skipped, so that a skip never reads as a pass.
    if _outcomes["skipped"] and not _outcomes["failed"] and exitstatus in (0, 5):
        session.exitstatus = 77
