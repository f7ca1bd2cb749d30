"""Files the root supervisor writes for the operator, in directories another local user
may own (a node_exporter textfile directory is typically the exporter's). The supervisor
must never follow a name that user planted there."""
import os

import pytest

from conftest import NOBODY, POLICIES, as_nobody, read_bytes, serve_client, wait_until, write_file


@pytest.fixture
def served_with_metrics(stockade, state_dir):
    """serve --metrics DIR/stockade.prom every 200 ms, DIR owned by nobody (0755); the
    client is yielded with the paths."""
    metrics_dir = os.path.join(state_dir, "textfile")
    os.mkdir(metrics_dir, 0o755)
    os.chown(metrics_dir, NOBODY, NOBODY)
    prom = os.path.join(metrics_dir, "stockade.prom")
    with serve_client(stockade, state_dir, POLICIES["process"],
                      extra=["--metrics", prom, "--metrics-interval", "200ms"],
                      serve_state=os.path.join(state_dir, "state")) as client:
        yield client, prom


def test_metrics_temp_file_symlink(served_with_metrics, state_dir):
    """The owner of the metrics directory plants `FILE.tmp.<pid>` (the supervisor's pid is
    public) as a symlink to a root-only file. Two metrics writes later the root-only file
    is untouched and the metrics file is a regular file the exporter can read."""
    client, prom = served_with_metrics
    secret_dir = os.path.join(state_dir, "rootonly")
    os.mkdir(secret_dir, 0o700)
    victim = os.path.join(secret_dir, "victim")
    write_file(victim, b"root-only content\n", 0o600)

    planted = f"{prom}.tmp.{client.proc.pid}"
    cp = as_nobody(f'ln -s "{victim}" "{planted}"')
    assert cp.returncode == 0 and os.path.islink(planted), cp       # control: nobody can plant

    seen = set()

    def two_writes():
        try:
            seen.add(os.lstat(prom).st_ino)
        except FileNotFoundError:
            pass
        return len(seen) >= 3          # the one there before, then two writes
    assert wait_until(two_writes, 20), f"the metrics file was not rewritten: {seen}"

    assert read_bytes(victim) == b"root-only content\n", \
        "the supervisor wrote its metrics through the planted symlink into a root-only file"
    st = os.lstat(prom)
    assert not os.path.islink(prom) and st.st_uid == 0, st
    assert st.st_mode & 0o777 == 0o644, oct(st.st_mode)
    assert b"stockade_" in read_bytes(prom)
