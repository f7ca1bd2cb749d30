/* Session records: atomic writes, no takeover of an existing id, a cut record refused,
 * one holder of a state dir's lock, a run alive while its lock is held (whatever its pid). */
#include "check.h"
#include "record.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[] = "/tmp/stockade-test-record-XXXXXX";

static struct session_record sample(const char *id)
{
    struct session_record r = {
        .owner = RECORD_SERVE, .state = RECORD_OPEN, .service_uid = true, .uid = 210007,
        .client_uid = 1000, .created_ms = 1000, .ttl_ms = 60000, .lease_at_ms = 91000,
        .fuse_at_ms = 3001000,
    };
    snprintf(r.id, sizeof r.id, "%s", id);
    snprintf(r.isolation, sizeof r.isolation, "strict");
    snprintf(r.policy_sha256, sizeof r.policy_sha256, "%064d", 7);
    r.labels = xcalloc(5, sizeof *r.labels);
    r.labels[0] = xstrdup("task");
    r.labels[1] = xstrdup("t 1\nend\n%");      /* what could shape a line, encoded */
    r.labels[2] = xstrdup("empty");
    r.labels[3] = xstrdup("");
    return r;
}

static void test_round_trip(void)
{
    struct session_record w = sample("s-1"), r;
    CHECK(record_write(dir, &w, true) == 0);
    CHECK(record_read(dir, "s-1", &r) == 0);
    CHECK_STR(r.id, "s-1");
    CHECK(r.owner == RECORD_SERVE && r.state == RECORD_OPEN && !r.kept && r.service_uid);
    CHECK(r.uid == 210007 && r.client_uid == 1000);
    CHECK(r.ttl_ms == 60000 && r.lease_at_ms == 91000 && r.fuse_at_ms == 3001000);
    CHECK_STR(r.isolation, "strict");
    CHECK(r.labels && r.labels[0] && r.labels[1] && r.labels[2] && r.labels[3] && !r.labels[4]);
    if (r.labels && r.labels[3]) {
        CHECK_STR(r.labels[0], "task");
        CHECK_STR(r.labels[1], "t 1\nend\n%");
        CHECK_STR(r.labels[2], "empty");
        CHECK_STR(r.labels[3], "");
    }
    CHECK(!record_expired(dir, &r, 90999));
    CHECK(record_expired(dir, &r, 91000));
    record_clear(&r);
    /* create never takes over; an update replaces */
    errno = 0;
    CHECK(record_write(dir, &w, true) < 0 && errno == EEXIST);
    w.state = RECORD_CLOSING;
    CHECK(record_write(dir, &w, false) == 0);
    CHECK(record_read(dir, "s-1", &r) == 0 && r.state == RECORD_CLOSING);
    CHECK(record_expired(dir, &r, 0));
    record_clear(&r);
    /* no temp left behind */
    char **ids = record_ids(dir);
    CHECK(ids && ids[0] && !strcmp(ids[0], "s-1") && !ids[1]);
    strv_free(ids);
    CHECK(record_remove(dir, "s-1") == 0);
    CHECK(record_remove(dir, "s-1") == 0);
    errno = 0;
    CHECK(record_read(dir, "s-1", &r) < 0 && errno == ENOENT);
    record_clear(&w);
}

/* A record cut short (a crash in a write that was not atomic) is not a record. */
static void test_cut_record_refused(void)
{
    struct session_record w = sample("s-2"), r;
    CHECK(record_write(dir, &w, true) == 0);
    char *path = xasprintf("%s/records/s-2", dir);
    struct stat st;
    CHECK(stat(path, &st) == 0);
    CHECK(truncate(path, st.st_size - 4) == 0);     /* "end\n" gone */
    errno = 0;
    CHECK(record_read(dir, "s-2", &r) < 0 && errno == EINVAL);
    free(path);
    CHECK(record_remove(dir, "s-2") == 0);
    record_clear(&w);
    /* and an id that is not one is refused before any path is made of it */
    errno = 0;
    CHECK(record_read(dir, "../x", &r) < 0 && errno == EINVAL);
}

static void test_state_dir_lock(void)
{
    char *err = NULL;
    CHECK(record_state_dir_owner(dir) == 0);
    int fd = record_lock_state_dir(dir, &err);
    CHECK(fd >= 0);
    CHECK(record_state_dir_owner(dir) == getpid());
    int again = record_lock_state_dir(dir, &err);
    CHECK(again < 0);
    CHECK(err && strstr(err, "in use by another stockade"));
    free(err);
    close(fd);
    CHECK(record_state_dir_owner(dir) == 0);
}

/* A pid no process has now: a child's, reaped. */
static pid_t dead_pid(void)
{
    pid_t pid = fork();
    if (pid == 0)
        _exit(0);
    waitpid(pid, NULL, 0);
    return pid;
}

/* A run's record says it is alive while its holder's lock is held, whatever its pid says
 * (a pid of another namespace, or a reused one); gone once the lock is let go. */
static void test_run_holder(void)
{
    struct session_record w = sample("run-1"), r;
    w.owner = RECORD_RUN;
    w.pid = dead_pid();
    int fd = record_holder_take(dir, w.holder);
    CHECK(fd >= 0 && !strncmp(w.holder, ".holder.", 8));
    CHECK(record_write(dir, &w, true) == 0);
    CHECK(record_read(dir, "run-1", &r) == 0 && !strcmp(r.holder, w.holder));
    CHECK(record_process_alive(dir, &r) == 1);
    CHECK(!record_expired(dir, &r, 0));
    CHECK(record_holders_sweep(dir) == 0);
    /* another name for the same run: its pid reused by a live process changes nothing */
    r.pid = getpid();
    close(fd);                      /* a crash: the lock goes, the file stays */
    CHECK(record_process_alive(dir, &r) == 0);
    CHECK(record_expired(dir, &r, 0));
    CHECK(record_holders_sweep(dir) == 1);
    CHECK(record_process_alive(dir, &r) == 0);     /* its file gone: still gone */
    record_clear(&r);

    /* an older version's record (no holder): its pid is all there is */
    memset(w.holder, 0, sizeof w.holder);
    w.pid = getpid();
    CHECK(record_write(dir, &w, false) == 0);
    CHECK(record_read(dir, "run-1", &r) == 0 && !r.holder[0]);
    CHECK(record_process_alive(dir, &r) == 1);
    r.pid = dead_pid();
    CHECK(record_process_alive(dir, &r) == 0);
    record_clear(&r);

    /* taken before anything else in a state dir not made yet; a clean exit takes its
     * file away */
    char name[RECORD_HOLDER_MAX];
    char *fresh = xasprintf("%s/fresh", dir);
    fd = record_holder_take(fresh, name);
    CHECK(fd >= 0);
    char *path = xasprintf("%s/records/%s", fresh, name);
    CHECK(access(path, F_OK) == 0);
    record_holder_drop(fresh, name, fd);
    CHECK(access(path, F_OK) < 0 && errno == ENOENT);
    free(path);
    free(fresh);

    /* a holder that is not one of ours names no file */
    path = xasprintf("%s/records/run-1", dir);
    int rfd = open(path, O_WRONLY | O_TRUNC);
    const char *bad = "stockade-session-record 1\nid run-1\nowner run\nholder ../lock\nend\n";
    CHECK(rfd >= 0 && write(rfd, bad, strlen(bad)) == (ssize_t)strlen(bad));
    close(rfd);
    errno = 0;
    CHECK(record_read(dir, "run-1", &r) < 0 && errno == EINVAL);
    free(path);
    CHECK(record_remove(dir, "run-1") == 0);
    record_clear(&w);
}

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    log_threshold = LOG_ERROR;
    test_round_trip();
    test_cut_record_refused();
    test_state_dir_lock();
    test_run_holder();
    check_remove_dir(dir);
    return check_report("test_record");
}
