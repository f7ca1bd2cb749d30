"""Fixtures for the redaction suite: a real `stockade serve` on stdio, driven by the
Python client, with the policies of tests/fixtures (or policies/default.lua).

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python \\
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/redact
"""

import os

import pytest

from serve_helpers import ServeProc, stop_all
from stockade_testlib import PLUGINS, POLICY, state_directory, stockade  # noqa: F401 (a fixture)


@pytest.fixture
def serve(stockade, tmp_path):
    """serve(policy=policies/default.lua) -> ServeProc on stdio, stopped at teardown."""
    servers = []
    # state_directory (under /var/tmp), not tmp_path: a tool under its own uid must be
    # able to reach its root
    with state_directory("stockade-rd-") as state:
        def start(policy=POLICY):
            s = ServeProc(stockade, state, policy, log_dir=str(tmp_path),
                          extra_env={"STOCKADE_PLUGIN_PATH": os.environ.get(
                              "STOCKADE_PLUGIN_PATH", PLUGINS)})
            servers.append(s)
            return s

        def report(s):
            with open(s.log_path, "rb") as f:
                print(f"---- stderr of serve\n{f.read()[-4000:].decode('utf-8', 'replace')}")

        yield start
        stop_all(servers, report)
