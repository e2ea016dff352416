"""The examples in examples/pytorch run (briefly) as they are."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="python3-torch is not installed")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(script, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pytorch", script),
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_hivemind_style_script_differs_only_in_its_import():
    src = open(os.path.join(ROOT, "examples", "pytorch", "hivemind_style.py")).read()
    assert "import apiary as hivemind" in src
    body = src.replace("import apiary as hivemind", "import hivemind")
    assert "apiary" not in body.split('"""', 2)[2].replace("import hivemind", "")
    out = run("hivemind_style.py", "--steps", "16")
    assert out.returncode == 0, out.stderr
    m = re.search(r"epochs (\d+) loss (\S+) -> (\S+)", out.stdout)
    assert m, out.stdout
    assert int(m.group(1)) == 8  # 16 steps of 16 samples, 32 per epoch
    assert float(m.group(3)) < float(m.group(2))
