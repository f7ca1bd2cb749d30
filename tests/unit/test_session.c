/* Sessions: ids come from the kernel's random source or not at all. Linked with
 * -Wl,--wrap=getrandom (Makefile) so that the random source can be made to fail. */
#include "check.h"
#include "session.h"
#include "util.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/random.h>
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

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    log_threshold = LOG_ERROR;
    test_random_id();
    test_no_random_no_session();
    check_remove_dir(dir);
    return check_report("test_session");
}
