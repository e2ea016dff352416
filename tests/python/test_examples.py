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


def test_cnn_trains():
    out = run("cnn.py", "--listen", "/ip4/127.0.0.1/tcp/0", "--epochs", "40", "--batch-size",
              "32", "--target-batch-size", "32", "--seed", "1", "--matchmaking-time", "0.05")
    assert out.returncode == 0, out.stderr
    acc = [float(m) for m in re.findall(r"accuracy (\S+)", out.stdout)]
    assert len(acc) >= 40 and max(acc[-5:]) > 0.5, out.stdout


def test_char_transformer_runs():
    out = run("char_transformer.py", "--listen", "/ip4/127.0.0.1/tcp/0", "--epochs", "2",
              "--batch-size", "4", "--context", "32", "--target-batch-size", "4")
    assert out.returncode == 0, out.stderr
    assert re.search(r"epoch 2 loss", out.stdout), out.stdout
