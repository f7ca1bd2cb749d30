/* Sessions: ids come from the kernel's random source or not at all. Linked with
 * -Wl,--wrap=getrandom (Makefile) so that the random source can be made to fail. */
#include "check.h"
#include "record.h"
#include "session.h"
#include "util.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/types.h>

ssize_t __real_getrandom(void *buf, size_t len, unsigned int flags);
ssize_t __wrap_getrandom(void *buf, size_t len, unsigned int flags);

static bool random_fails;

ssize_t __wrap_getrandom(void *buf, size_t len, unsigned int flags)
{
    if (random_fails) {
        errno = ENOSYS;
        return -1;
    }
    return __real_getrandom(buf, len, flags);
}

static char dir[] = "/tmp/stockade-test-session-XXXXXX";

static void test_random_id(void)
{
    char *err = NULL;
    struct session *s = session_open(dir, NULL, false, UID_RANGE_DEFAULT, &err);
    CHECK(s != NULL);
    if (!s) {
        fprintf(stderr, "session_open: %s\n", err);
        free(err);
        return;
    }
    CHECK(strlen(s->id) == 36 && s->id[14] == '4');
    CHECK(session_close(s) == 0);
}

/* No random source: no session, rather than a guessable id. */
static void test_no_random_no_session(void)
{
    random_fails = true;
    char *err = NULL;
    struct session *s = session_open(dir, NULL, false, UID_RANGE_DEFAULT, &err);
    random_fails = false;
    CHECK(s == NULL);
    CHECK(err && strstr(err, "getrandom"));
    free(err);
    session_close(s);
}

static bool exists(const char *sub, const char *id)
{
    char *path = xasprintf("%s/%s/%s", dir, sub, id);
    struct stat st;
    bool yes = lstat(path, &st) == 0;
    free(path);
    return yes;
}

/* The record comes before the root and goes after it; an id is never taken over; an
 * adopted session gets back its own uid, or nothing. */
static void test_recorded(void)
{
    struct session_record rec = {.owner = RECORD_SERVE, .ttl_ms = 1000, .lease_at_ms = 1,
                                 .fuse_at_ms = 1};
    char *err = NULL;
    struct session *s = session_open_recorded(dir, "rec-1", false, UID_RANGE_DEFAULT, &rec, &err);
    CHECK(s != NULL);
    if (!s) {
        fprintf(stderr, "session_open_recorded: %s\n", err);
        free(err);
        return;
    }
    CHECK(exists("records", "rec-1") && exists("sessions", "rec-1"));
    struct session_record back;
    CHECK(record_read(dir, "rec-1", &back) == 0 && back.uid == s->uid);
    struct session *twin = session_open_recorded(dir, "rec-1", false, UID_RANGE_DEFAULT, &rec,
                                                 &err);
    CHECK(twin == NULL && errno == EEXIST);
    free(err);
    err = NULL;
    CHECK(exists("records", "rec-1"));          /* the refused twin removed nothing */
    if (geteuid() == 0) {
        /* its uid is held (by s): adoption refuses rather than share it */
        struct session *a = session_adopt(dir, &back, &err);
        CHECK(a == NULL && errno == EBUSY);
        free(err);
        err = NULL;
    }
    CHECK(session_close(s) == 0);
    CHECK(!exists("records", "rec-1") && !exists("sessions", "rec-1"));
    /* no root: nothing to adopt */
    struct session *a = session_adopt(dir, &back, &err);
    CHECK(a == NULL && errno == ENOENT);
    free(err);
    record_clear(&back);
}

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    log_threshold = LOG_ERROR;
    test_random_id();
    test_no_random_no_session();
    test_recorded();
    check_remove_dir(dir);
    return check_report("test_session");
}
