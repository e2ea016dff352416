"""Shared fixtures: the apiary CLI of this build and a way to start C peers."""
import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))


def apiary_bin():
    b = os.environ.get("APIARY_BIN") or os.path.join(ROOT, "build", "apiary")
    if not os.path.exists(b):
        pytest.skip("the apiary CLI is not built (%s)" % b)
    return b


class CPeer:
    """`apiary dht` as a child process on loopback; .addr is its multiaddr with /p2p/."""

    def __init__(self, *extra):
        self.proc = subprocess.Popen([apiary_bin(), "dht", "--listen", "/ip4/127.0.0.1/tcp/0",
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.addr = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)", line)
            if m:
                self.addr = m.group(1)
                break
        if not self.addr:
            self.stop()
            raise RuntimeError("apiary dht did not print its address: %s" % self.proc.stderr.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def c_peer():
    p = CPeer()
    yield p
    p.stop()
