"""Strict sessions from worlds made ahead (core/zygote.c, zygote_bind).

A root server keeps the next strict session's world built ahead of it: namespaces, the
host's system trees, /dev, the sealed read-only root, everything but the session's own
root and tmp, which `session.open` hands over as detached mounts. These tests judge that
shortcut from inside the world and from the host: a session sees only its own root and
processes, its root is read-only again once bound, a policy mount never shows on the
host, a reload remakes the world made ahead for the new policy, and no world made ahead
is ever left behind."""
import json
import os
import secrets

from conftest import POLICIES, VISIBLE_BASE, mkdir_mode, serve_client, strict_only, \
    wait_until, write_file

PROBE = r"""
import errno, json, os, sys
root = os.environ["AGENT_ROOT"]
other = sys.argv[1]
out = {"root": root, "other_visible": os.path.exists(other)}
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
try:
    open("/planted", "w").close()
    out["root_write"] = "allowed"
except OSError as e:
    out["root_write"] = errno.errorcode.get(e.errno, str(e.errno))
tag = os.path.basename(other)
out["mounts_naming_other"] = [l for l in open("/proc/self/mountinfo") if tag in l]
with open("/tmp/" + sys.argv[2], "w") as f:
    f.write("tmp")
with open("/sys/class/net/lo/flags") as f:
    out["lo_up"] = bool(int(f.read(), 16) & 1)
out["hostname"] = os.uname().nodename
print(json.dumps(out))
"""


def _policy(dirpath, network='"none"', mounts=None):
    with open(POLICIES["strict"]) as f:
        text = f.read()
    text = text.replace('network = "none",', f"network = {network},")
    if mounts:
        text = text.replace("  tools = {", f"  mounts = {{ {mounts} }},\n  tools = {{", 1)
    path = os.path.join(dirpath, f"policy-{secrets.token_hex(4)}.lua")
    write_file(path, text)
    return path


def _probe(session, other, tmp_name):
    r = session.call("python3", ["-c", PROBE, other, tmp_name])
    assert r.ok, (r.class_, r.message, r.stderr[-2000:])
    return json.loads(r.stdout)


def _worlds_when(server_pid, n, others_than=(), bound=20):
    """The server's worlds once there are n of them, none of them in `others_than` (a
    killed one is listed until it is reaped); None after `bound` s."""
    def ready():
        w = _worlds(server_pid)
        return w if len(w) == n and not set(w) & set(others_than) else None
    return wait_until(ready, bound)


def _world_ahead(server_pid):
    """The one world made ahead of a server with no session (its pid)."""
    ahead = _worlds_when(server_pid, 1)
    assert ahead, f"no world made ahead: {_worlds(server_pid)}"
    return ahead[0]


def _worlds(server_pid):
    """The server's children in a network namespace of their own: session zygotes and
    the world made ahead (the spawner shares the host's)."""
    host_net = os.readlink(f"/proc/{server_pid}/ns/net")
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and os.readlink(f"/proc/{p}/ns/net") != host_net:
                found.append(int(p))
        except OSError:
            continue            # gone meanwhile
    return sorted(found)


@strict_only("worlds made ahead are strict's")
def test_a_session_from_a_world_made_ahead_holds_only_its_own(stockade, state_dir, level):
    with serve_client(stockade, state_dir, POLICIES[level]) as client:
        first = client.open_session()
        a = _probe(first, "/nonexistent-" + secrets.token_hex(4), "a-" + secrets.token_hex(4))
        second = client.open_session()
        tmp_name = "b-" + secrets.token_hex(4)
        b = _probe(second, first.root, tmp_name)
        assert a["root"] == first.root and b["root"] == second.root != first.root, (a, b)
        # the other session's root is not in this world, under any mount
        assert not b["other_visible"] and b["mounts_naming_other"] == [], b
        # its own processes only: its runner (pid 1 of the namespace) and the tool
        assert len(b["pids"]) <= 2 and 1 in b["pids"], b
        # the root the world was sealed with is read-only again once the session is bound
        assert b["root_write"] == "EROFS", b
        assert not b["lo_up"] and b["hostname"] == "stockade", b
        # /tmp in the world is the session's tmp on the host
        assert os.path.isfile(os.path.join(second.root, "tmp", tmp_name)), \
            "the tool's /tmp is not its session's tmp"
        for s in (first, second):
            s.close()


@strict_only("policy mounts exist only in the strict world")
def test_a_policy_mount_in_a_world_made_ahead_stays_in_it(stockade, state_dir, cleanup, level):
    src = mkdir_mode(VISIBLE_BASE, 0o755)
    cleanup(src)
    secret = secrets.token_hex(8)
    write_file(os.path.join(src, "README"), secret + "\n")
    pol = _policy(state_dir, mounts=f'{{ "{src}", "workspace/repo", ro = true }}')
    with serve_client(stockade, state_dir, pol) as client:
        for _ in range(2):          # the first world made at start, then one made after
            s = client.open_session()
            r = s.call("sh", ["-c", 'cat "$AGENT_ROOT/workspace/repo/README"'])
            assert r.ok and r.stdout.decode().strip() == secret, (r.class_, r.stderr)
            with open("/proc/self/mountinfo") as f:
                leaked = [line for line in f if s.root in line]
            # made beneath a detached copy of the root: with shared propagation it would
            # show here, and the root could not be removed
            assert leaked == [], leaked
            root = s.root
            s.close()
            assert wait_until(lambda: not os.path.exists(root), 20), \
                f"the session's root {root} was not removed"


@strict_only("worlds made ahead are strict's")
def test_a_reload_remakes_the_world_made_ahead(stockade, state_dir, level):
    pol = _policy(state_dir)
    with serve_client(stockade, state_dir, pol) as client:
        s1 = client.open_session()
        before = _probe(s1, "/nonexistent", "t1")
        assert not before["lo_up"], before
        with open(pol) as f:
            text = f.read()
        write_file(pol, text.replace('network = "none",', 'network = "loopback",'))
        client.reload_policy()
        s2 = client.open_session()
        after = _probe(s2, "/nonexistent", "t2")
        # a world made for the old policy would have its loopback down
        assert after["lo_up"], after
        s1.close()
        s2.close()


@strict_only("worlds made ahead are strict's")
def test_one_world_is_kept_ahead_and_none_is_left(stockade, state_dir, level):
    with serve_client(stockade, state_dir, POLICIES[level]) as client:
        pid = client.proc.pid
        ahead = _world_ahead(pid)
        sessions = [client.open_session() for _ in range(3)]
        for s in sessions:
            assert s.call("true").ok
        # each session's own world, and one more made ahead (not the first one: taken)
        now = _worlds_when(pid, 4)
        assert now and ahead in now, (ahead, _worlds(pid))
        for s in sessions:
            s.close()
        left = _worlds_when(pid, 1, others_than=[ahead])
        assert left, (ahead, _worlds(pid))


@strict_only("worlds made ahead are strict's")
def test_a_killed_world_made_ahead_is_replaced_and_reaped(stockade, state_dir, level):
    with serve_client(stockade, state_dir, POLICIES[level]) as client:
        pid = client.proc.pid
        ahead = _world_ahead(pid)
        os.kill(ahead, 9)
        s = client.open_session()           # builds its own, or a replacement's
        r = s.call("sh", ["-c", "echo fine"])
        assert r.ok and r.stdout == b"fine\n", (r.class_, r.message)
        # the dead one reaped (no zombie left), one world made ahead again beside the
        # session's
        now = wait_until(lambda: len(_worlds(pid)) == 2 and not os.path.exists(f"/proc/{ahead}"),
                         20)
        assert now, (ahead, _worlds(pid))
        s.close()


@strict_only("policy mounts exist only in the strict world")
def test_a_policy_mount_is_taken_as_it_is_when_the_session_opens(stockade, state_dir, cleanup,
                                                                 level):
    """The operator replaces a mount's source after the world was made ahead: the next
    session sees the new one, as a world built for it would."""
    src = os.path.join(VISIBLE_BASE, "prep-src-" + secrets.token_hex(4))
    cleanup(src)
    cleanup(src + ".old")
    os.mkdir(src, 0o755)
    write_file(os.path.join(src, "f"), "OLD\n")
    pol = _policy(state_dir, mounts=f'{{ "{src}", "workspace/x", ro = true }}')
    with serve_client(stockade, state_dir, pol) as client:
        _world_ahead(client.proc.pid)
        os.rename(src, src + ".old")
        os.mkdir(src, 0o755)
        write_file(os.path.join(src, "f"), "NEW\n")
        s = client.open_session()
        r = s.call("sh", ["-c", 'cat "$AGENT_ROOT/workspace/x/f"'])
        assert r.ok and r.stdout == b"NEW\n", (r.class_, r.stdout, r.stderr)
        s.close()


@strict_only("worlds made ahead are strict's")
def test_a_session_ended_before_its_answer_leaves_a_world_ahead(stockade, state_dir, level):
    """A lease shorter than the bind: the session ends while its world (the one made
    ahead) is still starting, and is refused; the next world is made all the same."""
    from stockade_client.errors import StockadeError
    with serve_client(stockade, state_dir, POLICIES[level]) as client:
        pid = client.proc.pid
        first = _world_ahead(pid)
        try:
            client.open_session(ttl_ms=1).close()
        except StockadeError:
            pass                # refused: it ended before its sandbox was ready
        # the first one, its session's, is stopped; the next one is made after it
        again = _worlds_when(pid, 1, others_than=[first])
        assert again, (first, _worlds(pid))
        s = client.open_session()
        assert s.call("true").ok
        s.close()
