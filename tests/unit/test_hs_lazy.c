/* Vectorscan loaded on first use (core/hs_lazy.c): a load that failed for a passing
 * reason (out of descriptors here, as at EMFILE in a busy server) is tried again by the
 * next compile, not remembered for the process's life. */
#include "check.h"
#include "util.h"

#include <errno.h>
#include <hs.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static hs_error_t compile_one(char **why)
{
    hs_database_t *db = NULL;
    hs_compile_error_t *error = NULL;
    hs_error_t rc = hs_compile("sec[r]et", 0, HS_MODE_BLOCK, NULL, &db, &error);
    *why = xstrdup(error ? error->message : "");
    hs_free_compile_error(error);
    hs_free_database(db);
    return rc;
}

static void test_load_retried_after_emfile(void)
{
    /* every descriptor taken: the dlopen cannot open the library */
    struct rlimit old, low;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
    low = old;
    low.rlim_cur = 64;
    CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
    int held[64], n = 0;
    while (n < 64 && (held[n] = dup(0)) >= 0)
        n++;
    CHECK(n < 64 && errno == EMFILE);
    char *why = NULL;
    CHECK(compile_one(&why) == HS_COMPILER_ERROR);
    CHECK(strstr(why, "cannot be loaded") != NULL);
    free(why);
    while (n > 0)
        close(held[--n]);
    CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0);
    /* descriptors back: the next compile loads it */
    CHECK(compile_one(&why) == HS_SUCCESS);
    if (strlen(why))
        fprintf(stderr, "compile: %s\n", why);
    free(why);
}

int main(void)
{
    log_threshold = LOG_ERROR;
    test_load_retried_after_emfile();
    return check_report("test_hs_lazy");
}
