/* Session records: atomic writes, no takeover of an existing id, a cut record refused,
 * one holder of a state dir's lock. */
#include "check.h"
#include "record.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
    CHECK(!record_expired(&r, 90999));
    CHECK(record_expired(&r, 91000));
    record_clear(&r);
    /* create never takes over; an update replaces */
    errno = 0;
    CHECK(record_write(dir, &w, true) < 0 && errno == EEXIST);
    w.state = RECORD_CLOSING;
    CHECK(record_write(dir, &w, false) == 0);
    CHECK(record_read(dir, "s-1", &r) == 0 && r.state == RECORD_CLOSING);
    CHECK(record_expired(&r, 0));
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

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    log_threshold = LOG_ERROR;
    test_round_trip();
    test_cut_record_refused();
    test_state_dir_lock();
    check_remove_dir(dir);
    return check_report("test_record");
}
