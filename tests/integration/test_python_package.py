"""contrib/python installs offline with Debian's setuptools (pyproject.toml, py.typed),
and every public method of the clients says what it does."""

import inspect
import os
import shutil
import subprocess

import pytest

from stockade_testlib import REPO_ROOT

import stockade_client
from stockade_client import (AsyncCallHandle, AsyncClient, AsyncSession, CallHandle, CallResult,
                             Client, ServerInfo, Session, SessionInfo, StockadeError)
from stockade_client import _proto


def test_pip_installs_it_offline(tmp_path):
    if subprocess.run(["/usr/bin/python3", "-m", "pip", "--version"],
                      capture_output=True).returncode != 0:
        pytest.skip("no pip for /usr/bin/python3 (Debian: python3-pip)")
    src = tmp_path / "src"
    shutil.copytree(os.path.join(REPO_ROOT, "contrib", "python"), src,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    target = tmp_path / "target"
    cp = subprocess.run(["/usr/bin/python3", "-m", "pip", "install", "--no-index",
                         "--no-build-isolation", "--no-deps", "--target", str(target), str(src)],
                        capture_output=True, timeout=300)
    assert cp.returncode == 0, cp.stderr.decode()[-3000:]
    assert (target / "stockade_client" / "py.typed").exists()
    env = dict(os.environ, PYTHONPATH=str(target))
    cp = subprocess.run(["/usr/bin/python3", "-c",
                         "import stockade_client as s; print(s.__file__, s.PROTOCOL_VERSION)"],
                        cwd=str(tmp_path), env=env, capture_output=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    where, version = cp.stdout.decode().split()
    assert where.startswith(str(target)) and version == "2"


@pytest.mark.parametrize("cls", [Client, Session, CallHandle, AsyncClient, AsyncSession,
                                 AsyncCallHandle, CallResult, ServerInfo, SessionInfo,
                                 StockadeError, _proto.Core])
def test_every_public_method_has_a_docstring(cls):
    def public(m):
        return inspect.isfunction(m) or isinstance(m, property)
    missing = [name for name, fn in inspect.getmembers(cls, public)
               if not name.startswith("_") and not inspect.getdoc(fn)]
    assert missing == [], f"{cls.__name__}: no docstring on {missing}"
    assert inspect.getdoc(cls)


def test_sync_and_async_clients_have_the_same_methods():
    def public(cls):
        return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert public(Client) - {"spawn", "connect_unix"} == public(AsyncClient) - {"spawn", "connect_unix"}
    assert public(Session) == public(AsyncSession)
    assert stockade_client.PROTOCOL_VERSION == 2
