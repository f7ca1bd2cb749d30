#ifndef STOCKADE_ACCOUNTING_H
#define STOCKADE_ACCOUNTING_H
/* What the supervisor holds, read from the kernel (not from our own bookkeeping, which
 * is exactly what a leak would get wrong): descriptors by kind, processes and zombies
 * below us, resident memory. */
#include <stdbool.h>
#include <stdint.h>

struct acct_sample {
    int fds;                    /* all open descriptors */
    int fd_pipe, fd_pidfd, fd_socket, fd_other;
    unsigned processes, zombies;
    unsigned owned_zombies;     /* ours or a shim's to reap: the leak the alarm watches */
    int64_t rss_kb;
};

void acct_sample_take(struct acct_sample *s);

enum alarm_kind { ALARM_ZOMBIES, ALARM_FDS, ALARM_RSS, ALARM_PROCESSES, ALARM_SESSIONS,
                  ALARM_COUNT };
const char *alarm_kind_name(enum alarm_kind k);

/* One alarm's state: raised after `needed` consecutive samples over the threshold (a
 * zombie between exit and reap is not a leak), cleared after one under. */
struct alarm {
    int64_t threshold;
    int64_t value;
    unsigned over;              /* consecutive samples over */
    bool raised;
};
/* Feed a sample value; returns +1 when the alarm is raised now, -1 when cleared now. */
int alarm_update(struct alarm *a, int64_t value, unsigned needed);

#endif
