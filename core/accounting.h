#ifndef STOCKADE_ACCOUNTING_H
#define STOCKADE_ACCOUNTING_H
/* What the supervisor holds, read from the kernel (not from our own bookkeeping, which
 * is exactly what a leak would get wrong): descriptors by kind, processes and zombies
 * below us, resident memory. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define ACCT_ZOMBIE_PIDS 256

#include "call.h"
#include "util.h"

struct acct_sample {
    int fds;                    /* all open descriptors */
    int fd_pipe, fd_pidfd, fd_socket, fd_other;
    unsigned processes, zombies;
    unsigned owned_zombies;     /* ours or a shim's to reap: the leak the alarm watches */
    pid_t owned_zombie_pids[ACCT_ZOMBIE_PIDS];  /* the first of them */
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

/* ---- --metrics: Prometheus text exposition ------------------------------------------ */

#define METRICS_CLASSES (CLASS_INTERNAL + 1)
#define METRICS_BUCKETS 14          /* latency histogram bounds, seconds; +Inf beyond */

/* One tool's call latency as a cumulative histogram (aggregates across instances,
 * unlike quantiles). */
struct metrics_tool {
    char *tool;
    uint64_t bucket[METRICS_BUCKETS];   /* calls at or under metrics_bounds_s[i] */
    uint64_t count;
    double sum_s;
    struct metrics_tool *next;
};

/* The counters behind --metrics that only the server can count; it owns one. */
struct metrics {
    uint64_t calls[METRICS_CLASSES];     /* answered calls, by class */
    uint64_t rpc_errors[METRICS_CLASSES]; /* error responses, by class */
    uint64_t redactions;
    uint64_t sessions_opened, sessions_closed, sessions_expired;
    uint64_t reloads_ok, reloads_failed;
    int64_t last_reload_ms;              /* wall clock of the last accepted load */
    struct metrics_tool *tools;
};

/* What the server holds now, read when the file is written. */
struct metrics_gauges {
    unsigned sessions, running;
    const struct acct_sample *sample;
    bool alarm_raised[ALARM_COUNT];
    unsigned policy_generation;
};

void metrics_observe_call(struct metrics *m, const char *tool, enum call_class class,
                          int64_t duration_ms);
void metrics_rpc_error(struct metrics *m, const char *class);
void metrics_render(struct buf *out, const struct metrics *m, const struct metrics_gauges *g);
/* Replace `path` with `len` bytes: a fresh file (mkstemp, never a name that exists) in
 * path's directory, mode 0644, renamed over path, so a reader never sees half a file and
 * a name planted in the directory is never followed. 0, or -1 with errno. */
int metrics_file_replace(const char *path, const char *text, size_t len);
void metrics_free(struct metrics *m);
/* Zombies are normal for an instant (between a child's exit and its reaping), and a busy
 * server has a few at every sample, each a different one: counting them raised and
 * cleared the alarm again and again. What is a leak is the same zombie, sample after
 * sample. This remembers each owned zombie's pid and for how many consecutive samples
 * it has been seen. */
struct zombie_watch {
    pid_t pid[ACCT_ZOMBIE_PIDS];
    unsigned seen[ACCT_ZOMBIE_PIDS];    /* consecutive samples, this one included */
    unsigned n;
};
/* Feed one sample; returns how many owned zombies have now been seen in at least
 * `samples` consecutive samples (those beyond the pids kept count as old ones). */
unsigned zombie_watch_update(struct zombie_watch *w, const struct acct_sample *s,
                             unsigned samples);

/* Whether `stats` takes a fresh sample rather than the last one: when something changed
 * (calls or sessions came or went) or the last is ACCT_RESAMPLE_MS old, but, once a walk
 * costs ACCT_RESAMPLE_COSTLY_MS or more, never sooner than ACCT_RESAMPLE_SPACING times
 * what the last one cost. A walk grows with the calls' process trees (~40 us a process),
 * so pipelined `stats` during a fork bomb would otherwise keep the loop walking /proc;
 * this keeps it under a tenth of the time. */
#define ACCT_RESAMPLE_MS 20
#define ACCT_RESAMPLE_COSTLY_MS 5
#define ACCT_RESAMPLE_SPACING 10
bool acct_resample_due(bool changed, int64_t age_ms, int64_t last_cost_ms);

#endif
