/* The loop's liveness pieces on their own: the zombie alarm's grace, the per-turn bound
 * on a connection's pipelined requests, and root removal off the loop. */
#include "accounting.h"
#include "check.h"
#include "remover.h"
#include "rpc.h"
#include "util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static void sample_with(struct acct_sample *s, const pid_t *pids, unsigned n)
{
    memset(s, 0, sizeof *s);
    s->owned_zombies = n;
    for (unsigned i = 0; i < n; i++)
        s->owned_zombie_pids[i] = pids[i];
}

/* A busy server has a zombie or two at every sample, each a different one: no alarm.
 * The same zombie three samples in a row: the alarm. */
static void test_zombie_grace(void)
{
    struct zombie_watch w = {.n = 0};
    struct alarm a = {.threshold = 0};
    struct acct_sample s;
    int changes = 0;
    for (pid_t p = 100; p < 160; p += 2) {
        pid_t pids[2] = {p, p + 1};
        sample_with(&s, pids, 2);
        changes += alarm_update(&a, zombie_watch_update(&w, &s, 3), 1) != 0;
    }
    CHECK(changes == 0);
    CHECK(!a.raised);

    pid_t leak[2] = {999, 1000};
    sample_with(&s, leak, 1);
    CHECK(zombie_watch_update(&w, &s, 3) == 0);
    leak[1] = 1001;                 /* a passing one beside the leak */
    sample_with(&s, leak, 2);
    CHECK(zombie_watch_update(&w, &s, 3) == 0);
    sample_with(&s, leak, 1);
    unsigned old = zombie_watch_update(&w, &s, 3);
    CHECK(old == 1);
    CHECK(alarm_update(&a, old, 1) == 1);
    sample_with(&s, NULL, 0);       /* reaped */
    CHECK(alarm_update(&a, zombie_watch_update(&w, &s, 3), 1) == -1);

    /* more zombies than pids kept: the extra ones count as old */
    struct acct_sample big;
    memset(&big, 0, sizeof big);
    big.owned_zombies = ACCT_ZOMBIE_PIDS + 5;
    for (unsigned i = 0; i < ACCT_ZOMBIE_PIDS; i++)
        big.owned_zombie_pids[i] = (pid_t)(5000 + i);
    CHECK(zombie_watch_update(&w, &big, 3) == 5);
}

/* ---- a pipelined flood is served a slice per loop turn ---- */

static unsigned messages_seen;

static void count_message(struct rpc_conn *c, const msgpack_object *msg)
{
    (void)c, (void)msg;
    messages_seen++;
}

static void ignore_close(struct rpc_conn *c, const char *why) { (void)c, (void)why; }

static const struct rpc_handlers counting = {count_message, ignore_close, NULL};

static void test_dispatch_bound(void)
{
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    /* 1,000 `stats` requests in one write: far more than one turn's share */
    static const unsigned char req[] = {0x94, 0x00, 0x01, 0xa5, 's', 't', 'a', 't', 's', 0x80};
    struct buf b = {0};
    for (int i = 0; i < 1000; i++)
        buf_append(&b, req, sizeof req);
    CHECK(write(sv[0], b.data, b.len) == (ssize_t)b.len);
    buf_free(&b);
    struct rpc_conn *c = rpc_conn_new(loop, sv[1], sv[1], RPC_MAX_MESSAGE_DEFAULT, &counting, NULL);
    ev_run(loop, EVRUN_ONCE);
    CHECK(messages_seen > 0 && messages_seen <= RPC_DISPATCH_MAX);
    /* and the rest follows, turn after turn, without anything more to read (at least one
     * a turn: a turn descheduled past its slice on a loaded host may serve no more) */
    for (int turn = 0; turn < 1000 && messages_seen < 1000; turn++)
        ev_run(loop, EVRUN_NOWAIT);
    CHECK(messages_seen == 1000);
    rpc_conn_close(c, "done", 0);
    close(sv[0]);
    ev_loop_destroy(loop);
}

/* ---- `stats` re-walks /proc at most a tenth of the time ---- */

/* A walk costs ~40 us per process of our tree (a fork bomb's 1,000 processes: ~80 ms).
 * Resampling whenever calls came or went or every 20 ms let a `stats` flood during a fork
 * bomb spend the loop walking /proc; the walk's own cost now spaces the walks. */
static void test_resample_spacing(void)
{
    /* cheap walks: as before, on a change or every 20 ms */
    CHECK(acct_resample_due(true, 0, 0));
    CHECK(acct_resample_due(true, 1, 4));
    CHECK(!acct_resample_due(false, 10, 4));
    CHECK(acct_resample_due(false, 20, 4));
    CHECK(!acct_resample_due(true, 40, 5));     /* a 5 ms walk: 50 ms apart */
    /* an 80 ms walk: not again before 800 ms, changed or not */
    CHECK(!acct_resample_due(true, 25, 80));
    CHECK(!acct_resample_due(false, 500, 80));
    CHECK(acct_resample_due(true, 800, 80));
    CHECK(acct_resample_due(false, 800, 80));
}

/* ---- a flood of slow requests yields to everyone else's events ---- */

static struct rpc_conn *slow_conn;
static unsigned slow_seen, slow_seen_when_other_came;
static bool other_seen;

static void slow_message(struct rpc_conn *c, const msgpack_object *msg)
{
    (void)msg;
    if (c != slow_conn) {
        other_seen = true;
        slow_seen_when_other_came = slow_seen;
        return;
    }
    slow_seen++;
    /* a hook that runs to its budget: longer than a turn's dispatch slice */
    int64_t until = now_ms() + 2 * RPC_DISPATCH_SLICE_MS;
    while (now_ms() < until)
        ;
}

static const struct rpc_handlers slow = {slow_message, ignore_close, NULL};

/* Connection A pipelines requests that each take longer than a turn's slice; B's request
 * arrives meanwhile. Whenever B's is waiting, it goes before A's next one: A's backlog
 * runs after every other event of the same turn, so B waits behind at most the request
 * of A's that was running when it came, never behind one more. */
static void test_backlog_yields(void)
{
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    int a[2], b[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a) == 0);
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, b) == 0);
    static const unsigned char req[] = {0x94, 0x00, 0x01, 0xa5, 's', 't', 'a', 't', 's', 0x80};
    struct buf flood = {0};
    for (int i = 0; i < 10; i++)
        buf_append(&flood, req, sizeof req);
    CHECK(write(a[0], flood.data, flood.len) == (ssize_t)flood.len);
    buf_free(&flood);
    slow_conn = rpc_conn_new(loop, a[1], a[1], RPC_MAX_MESSAGE_DEFAULT, &slow, NULL);
    struct rpc_conn *other = rpc_conn_new(loop, b[1], b[1], RPC_MAX_MESSAGE_DEFAULT, &slow, NULL);
    ev_run(loop, EVRUN_ONCE);
    CHECK(slow_seen == 1);          /* one slow request per turn */
    /* B's request comes while A's backlog is due */
    CHECK(write(b[0], req, sizeof req) == (ssize_t)sizeof req);
    for (int turn = 0; turn < 100 && !other_seen; turn++)
        ev_run(loop, EVRUN_NOWAIT);
    CHECK(other_seen);
    CHECK(slow_seen_when_other_came == 1);
    for (int turn = 0; turn < 100 && slow_seen < 10; turn++)
        ev_run(loop, EVRUN_NOWAIT);
    CHECK(slow_seen == 10);         /* and A is served to the end */
    rpc_conn_close(slow_conn, "done", 0);
    rpc_conn_close(other, "done", 0);
    close(a[0]);
    close(b[0]);
    ev_loop_destroy(loop);
}

/* ---- root removal off the loop ---- */

struct removal {
    int calls;
    bool removed;
};

static void on_removed(void *ud, bool removed)
{
    struct removal *r = ud;
    r->calls++;
    r->removed = removed;
}

static void test_remover(void)
{
    char tmpl[] = "/tmp/stockade-remover-XXXXXX";
    char *dir = mkdtemp(tmpl);
    CHECK(dir != NULL);
    if (!dir)
        return;
    char *root = xasprintf("%s/sessions/s1/workspace", dir);
    char *p = xasprintf("%s/sessions", dir);
    mkdir(p, 0700);
    free(p);
    p = xasprintf("%s/sessions/s1", dir);
    mkdir(p, 0700);
    free(p);
    mkdir(root, 0700);
    for (int i = 0; i < 2000; i++) {
        p = xasprintf("%s/d%d", root, i);
        mkdir(p, 0700);
        free(p);
    }
    /* the uid's lock is released once the root is gone, not before */
    char *lockpath = xasprintf("%s/uidlock", dir);
    int lock = open(lockpath, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    CHECK(lock >= 0 && flock(lock, LOCK_EX | LOCK_NB) == 0);

    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    struct remover *rm = remover_new(loop);
    struct removal got = {0};
    remover_submit(rm, dir, "s1", NULL, lock, on_removed, &got);
    CHECK(got.calls == 0);          /* never from inside the submission */
    CHECK(remover_pending(rm) == 1);
    ev_run(loop, 0);                /* returns once the job has reported */
    CHECK(got.calls == 1 && got.removed);
    CHECK(remover_pending(rm) == 0);
    struct stat st;
    p = xasprintf("%s/sessions/s1", dir);
    CHECK(lstat(p, &st) < 0);
    free(p);
    int other = open(lockpath, O_RDWR | O_CLOEXEC);
    CHECK(other >= 0 && flock(other, LOCK_EX | LOCK_NB) == 0);
    close(other);

    /* nothing to remove: the uid alone is released, from the loop */
    struct removal none = {0};
    remover_submit(rm, dir, NULL, NULL, -1, on_removed, &none);
    ev_run(loop, 0);
    CHECK(none.calls == 1 && none.removed);
    remover_free(rm);
    ev_loop_destroy(loop);

    unlink(lockpath);
    p = xasprintf("%s/sessions", dir);
    rmdir(p);
    free(p);
    rmdir(dir);
    free(lockpath);
    free(root);
}

int main(void)
{
    test_zombie_grace();
    test_resample_spacing();
    test_dispatch_bound();
    test_backlog_yields();
    test_remover();
    return check_report("test_liveness");
}
