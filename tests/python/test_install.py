"""make install puts the package where Debian's /usr/bin/python3 looks under the
prefix, and the installed package finds the installed libapiary.so by itself (no
APIARY_LIB, no build tree)."""
import os
import shutil
import subprocess
import sys

import pytest


def test_installed_package_finds_its_library(tmp_path):
    lib = os.environ.get("APIARY_LIB")
    build = os.path.dirname(os.path.realpath(lib)) if lib else ""
    if not os.path.exists(os.path.join(build, "cmake_install.cmake")):
        pytest.skip("APIARY_LIB is not in a CMake build tree")
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("cmake not found")
    prefix = tmp_path / "prefix"
    r = subprocess.run([cmake, "--install", build, "--prefix", str(prefix)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    inits = list(prefix.glob("lib/python3*/dist-packages/apiary/__init__.py"))
    assert len(inits) == 1, inits
    pydir = inits[0].parent.parent
    assert (pydir / "apiary" / "_installed.py").exists()
    configured = ""
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_INSTALL_PREFIX:"):
                configured = line.split("=", 1)[1].strip()
    if configured == "/usr/local" and \
            os.path.realpath(sys.executable) == os.path.realpath("/usr/bin/python3"):
        # configured for /usr/local: the same directory there is on the interpreter's path
        rel = os.path.relpath(pydir, prefix)
        out = subprocess.run([sys.executable, "-c", "import sys; print('\\n'.join(sys.path))"],
                             capture_output=True, text=True, timeout=60).stdout.split("\n")
        assert os.path.join("/usr/local", rel) in out, (rel, out)
    env = {k: v for k, v in os.environ.items() if k not in ("APIARY_LIB", "PYTHONPATH")}
    env["PYTHONPATH"] = str(pydir)
    script = ("import apiary, apiary._lib as L\n"
              "d = apiary.DHT(host_maddrs=['/ip4/127.0.0.1/tcp/0'])\n"
              "print(L._find_library()); print(apiary.__file__); d.shutdown()\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    found, pkg = r.stdout.split()[:2]
    assert found.startswith(str(prefix)), found
    assert pkg.startswith(str(pydir)), pkg
