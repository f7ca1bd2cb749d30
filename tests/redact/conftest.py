"""Fixtures for the redaction suite: a real `stockade serve` on stdio, driven by the
Python client, with the policies of tests/fixtures (or policies/default.lua).

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python \\
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/redact
"""

import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "integration"))

from serve_helpers import ServeProc  # noqa: E402

sys.path.insert(0, HERE)

POLICY = os.path.join(REPO_ROOT, "policies", "default.lua")


@pytest.fixture(scope="session")
def stockade():
    path = os.environ.get("STOCKADE_BIN") or os.path.join(REPO_ROOT, "stockade")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"stockade binary not found at {path} (build it with `make`)")
    return path


@pytest.fixture
def serve(stockade, tmp_path):
    """serve(policy=policies/default.lua) -> ServeProc on stdio, stopped at teardown."""
    servers = []
    # /var/tmp, not tmp_path: a tool under its own uid must be able to reach its root
    state = os.path.realpath(tempfile.mkdtemp(prefix="stockade-rd-", dir="/var/tmp"))
    os.chmod(state, 0o755)

    def start(policy=POLICY):
        s = ServeProc(stockade, state, policy, log_dir=str(tmp_path),
                      extra_env={"STOCKADE_PLUGIN_PATH": os.environ.get(
                          "STOCKADE_PLUGIN_PATH", os.path.join(REPO_ROOT, "plugins"))})
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()
        with open(s.log_path, "rb") as f:
            print(f"---- stderr of serve\n{f.read()[-4000:].decode('utf-8', 'replace')}")
    shutil.rmtree(state, ignore_errors=True)
