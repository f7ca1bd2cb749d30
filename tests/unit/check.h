#ifndef STOCKADE_TEST_CHECK_H
#define STOCKADE_TEST_CHECK_H
/* A minimal test harness: CHECK records a failure and goes on; main ends with the plain
 * "N passed, N failed" line and a non-zero status when anything failed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_passed, check_failed;

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (cond) {                                                                        \
            check_passed++;                                                                \
        } else {                                                                           \
            check_failed++;                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);       \
        }                                                                                  \
    } while (0)

#define CHECK_STR(a, b)                                                                    \
    do {                                                                                   \
        const char *check_a = (a), *check_b = (b);                                         \
        if (check_a && check_b && strcmp(check_a, check_b) == 0) {                         \
            check_passed++;                                                                \
        } else {                                                                           \
            check_failed++;                                                                \
            fprintf(stderr, "%s:%d: CHECK_STR failed: \"%s\" != \"%s\"\n", __FILE__,       \
                    __LINE__, check_a ? check_a : "(null)", check_b ? check_b : "(null)"); \
        }                                                                                  \
    } while (0)

/* Remove a suite's scratch directory (made with mkdtemp) and all in it. */
static inline void check_remove_dir(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static inline int check_report(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
    return check_failed ? 1 : 0;
}

#endif
