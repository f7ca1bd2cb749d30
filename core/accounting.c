#include "accounting.h"
#include "proc.h"
#include "version.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const alarm_names[ALARM_COUNT] = {
    [ALARM_ZOMBIES] = "zombies", [ALARM_FDS] = "fds", [ALARM_RSS] = "rss",
    [ALARM_PROCESSES] = "processes", [ALARM_SESSIONS] = "sessions",
};

const char *alarm_kind_name(enum alarm_kind k) { return alarm_names[k]; }

void acct_sample_take(struct acct_sample *s)
{
    memset(s, 0, sizeof *s);
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        int self = dirfd(d);
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.')
                continue;
            if (atoi(de->d_name) == self)
                continue;
            char path[300], link[128];
            snprintf(path, sizeof path, "/proc/self/fd/%s", de->d_name);
            ssize_t n = readlink(path, link, sizeof link - 1);
            link[n > 0 ? n : 0] = 0;
            s->fds++;
            if (strncmp(link, "pipe:", 5) == 0)
                s->fd_pipe++;
            else if (strstr(link, "[pidfd]"))
                s->fd_pidfd++;
            else if (strncmp(link, "socket:", 7) == 0)
                s->fd_socket++;
            else
                s->fd_other++;
        }
        closedir(d);
    } else if (errno == EMFILE) {
        /* No descriptor left to look with: then every one below the limit is open, which
         * is the count (of unknown kinds) — not 0, which would clear the fds alarm at the
         * very moment descriptors run out. */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
            s->fds = s->fd_other = (int)(rl.rlim_cur < 1 << 20 ? rl.rlim_cur : 1 << 20);
    }
    proc_count_tree_pids(&s->processes, &s->zombies, &s->owned_zombies, s->owned_zombie_pids,
                         ACCT_ZOMBIE_PIDS);
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "re");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
            resident = 0;
        fclose(f);
    }
    s->rss_kb = resident * (sysconf(_SC_PAGESIZE) / 1024);
}

bool acct_resample_due(bool changed, int64_t age_ms, int64_t last_cost_ms)
{
    /* a walk of a few ms is not worth staleness: those are answered as before */
    if (last_cost_ms >= ACCT_RESAMPLE_COSTLY_MS && age_ms < ACCT_RESAMPLE_SPACING * last_cost_ms)
        return false;
    return changed || age_ms >= ACCT_RESAMPLE_MS;
}

unsigned zombie_watch_update(struct zombie_watch *w, const struct acct_sample *s,
                             unsigned samples)
{
    struct zombie_watch next = {.n = 0};
    unsigned kept = s->owned_zombies < ACCT_ZOMBIE_PIDS ? s->owned_zombies : ACCT_ZOMBIE_PIDS;
    unsigned old = 0;
    for (unsigned i = 0; i < kept; i++) {
        pid_t pid = s->owned_zombie_pids[i];
        unsigned seen = 1;
        for (unsigned j = 0; j < w->n; j++) {
            if (w->pid[j] == pid) {
                seen = w->seen[j] + 1;
                break;
            }
        }
        next.pid[next.n] = pid;
        next.seen[next.n++] = seen;
        old += seen >= samples;
    }
    *w = next;
    return old + (s->owned_zombies - kept);
}

int alarm_update(struct alarm *a, int64_t value, unsigned needed)
{
    a->value = value;
    if (a->threshold < 0)
        return 0;
    if (value > a->threshold) {
        if (++a->over >= needed && !a->raised) {
            a->raised = true;
            return 1;
        }
        return 0;
    }
    a->over = 0;
    if (a->raised) {
        a->raised = false;
        return -1;
    }
    return 0;
}

/* ---- --metrics ------------------------------------------------------------------------ */

static const double metrics_bounds_s[METRICS_BUCKETS] = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
};

void metrics_observe_call(struct metrics *m, const char *tool, enum call_class class,
                          int64_t duration_ms)
{
    if ((unsigned)class < METRICS_CLASSES)
        m->calls[class]++;
    if (!tool || duration_ms < 0)
        return;
    struct metrics_tool *t;
    for (t = m->tools; t; t = t->next)
        if (strcmp(t->tool, tool) == 0)
            break;
    if (!t) {
        t = xcalloc(1, sizeof *t);
        t->tool = xstrdup(tool);
        t->next = m->tools;
        m->tools = t;
    }
    double s = (double)duration_ms / 1000.0;
    for (int i = 0; i < METRICS_BUCKETS; i++)
        if (s <= metrics_bounds_s[i])
            t->bucket[i]++;
    t->count++;
    t->sum_s += s;
}

void metrics_rpc_error(struct metrics *m, const char *class)
{
    for (int i = 0; i < METRICS_CLASSES; i++)
        if (strcmp(call_class_name((enum call_class)i), class) == 0) {
            m->rpc_errors[i]++;
            return;
        }
    m->rpc_errors[CLASS_INTERNAL]++;
}

/* A label value as the exposition format wants it: backslash, quote and newline escaped. */
static void label_value(struct buf *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\' || *v == '"')
            buf_printf(b, "\\%c", *v);
        else if (*v == '\n')
            buf_printf(b, "\\n");
        else
            buf_append(b, v, 1);
    }
}

static void family(struct buf *b, const char *name, const char *type, const char *help)
{
    buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void metrics_render(struct buf *b, const struct metrics *m, const struct metrics_gauges *g)
{
    family(b, "stockade_build_info", "gauge", "The running build; the value is always 1.");
    buf_printf(b, "stockade_build_info{version=\"%s\"} 1\n", STOCKADE_VERSION);

    family(b, "stockade_calls_total", "counter", "Calls answered, by class.");
    uint64_t total = 0;
    for (int i = 0; i < METRICS_CLASSES; i++) {
        buf_printf(b, "stockade_calls_total{class=\"%s\"} %llu\n",
                   call_class_name((enum call_class)i), (unsigned long long)m->calls[i]);
        total += m->calls[i];
    }
    family(b, "stockade_timeout_ratio", "gauge", "Share of calls ended by their timeout.");
    buf_printf(b, "stockade_timeout_ratio %.6f\n",
               total ? (double)m->calls[CLASS_TOOL_TIMEOUT] / (double)total : 0.0);

    family(b, "stockade_rpc_errors_total", "counter", "Error responses sent, by class.");
    for (int i = 0; i < METRICS_CLASSES; i++)
        if (m->rpc_errors[i])
            buf_printf(b, "stockade_rpc_errors_total{class=\"%s\"} %llu\n",
                       call_class_name((enum call_class)i), (unsigned long long)m->rpc_errors[i]);

    family(b, "stockade_call_duration_seconds", "histogram", "Call latency by tool.");
    for (const struct metrics_tool *t = m->tools; t; t = t->next) {
        for (int i = 0; i < METRICS_BUCKETS; i++) {
            buf_printf(b, "stockade_call_duration_seconds_bucket{tool=\"");
            label_value(b, t->tool);
            buf_printf(b, "\",le=\"%g\"} %llu\n", metrics_bounds_s[i],
                       (unsigned long long)t->bucket[i]);
        }
        buf_printf(b, "stockade_call_duration_seconds_bucket{tool=\"");
        label_value(b, t->tool);
        buf_printf(b, "\",le=\"+Inf\"} %llu\n", (unsigned long long)t->count);
        buf_printf(b, "stockade_call_duration_seconds_sum{tool=\"");
        label_value(b, t->tool);
        buf_printf(b, "\"} %.6f\n", t->sum_s);
        buf_printf(b, "stockade_call_duration_seconds_count{tool=\"");
        label_value(b, t->tool);
        buf_printf(b, "\"} %llu\n", (unsigned long long)t->count);
    }

    family(b, "stockade_redactions_total", "counter", "Secrets redacted from call output.");
    buf_printf(b, "stockade_redactions_total %llu\n", (unsigned long long)m->redactions);
    family(b, "stockade_sessions_opened_total", "counter", "Sessions opened.");
    buf_printf(b, "stockade_sessions_opened_total %llu\n", (unsigned long long)m->sessions_opened);
    family(b, "stockade_sessions_closed_total", "counter", "Sessions closed by their client.");
    buf_printf(b, "stockade_sessions_closed_total %llu\n", (unsigned long long)m->sessions_closed);
    family(b, "stockade_sessions_expired_total", "counter",
           "Sessions ended by their lease (ttl) or fuse.");
    buf_printf(b, "stockade_sessions_expired_total %llu\n",
               (unsigned long long)m->sessions_expired);
    family(b, "stockade_policy_reloads_total", "counter", "Policy reloads, by result.");
    buf_printf(b, "stockade_policy_reloads_total{result=\"success\"} %llu\n"
                  "stockade_policy_reloads_total{result=\"failure\"} %llu\n",
               (unsigned long long)m->reloads_ok, (unsigned long long)m->reloads_failed);
    family(b, "stockade_policy_last_reload_timestamp_seconds", "gauge",
           "When the policy in force was loaded (Unix time).");
    buf_printf(b, "stockade_policy_last_reload_timestamp_seconds %.3f\n",
               (double)m->last_reload_ms / 1000.0);
    family(b, "stockade_policy_generation", "gauge", "Generation of the policy in force.");
    buf_printf(b, "stockade_policy_generation %u\n", g->policy_generation);

    family(b, "stockade_sessions", "gauge", "Sessions open now.");
    buf_printf(b, "stockade_sessions %u\n", g->sessions);
    family(b, "stockade_running", "gauge", "Calls whose process runs now.");
    buf_printf(b, "stockade_running %u\n", g->running);
    const struct acct_sample *s = g->sample;
    family(b, "stockade_processes", "gauge", "Processes below the supervisor.");
    buf_printf(b, "stockade_processes %u\n", s->processes);
    family(b, "stockade_zombies", "gauge", "Zombies below the supervisor.");
    buf_printf(b, "stockade_zombies %u\n", s->zombies);
    family(b, "stockade_rss_bytes", "gauge", "The supervisor's resident memory.");
    buf_printf(b, "stockade_rss_bytes %lld\n", (long long)s->rss_kb * 1024);
    family(b, "stockade_fds", "gauge", "The supervisor's open descriptors, by kind.");
    buf_printf(b, "stockade_fds{kind=\"pipe\"} %d\nstockade_fds{kind=\"pidfd\"} %d\n"
                  "stockade_fds{kind=\"socket\"} %d\nstockade_fds{kind=\"other\"} %d\n",
               s->fd_pipe, s->fd_pidfd, s->fd_socket, s->fd_other);
    family(b, "stockade_alarm", "gauge", "1 while an accounting alarm is raised.");
    for (int k = 0; k < ALARM_COUNT; k++)
        buf_printf(b, "stockade_alarm{kind=\"%s\"} %d\n", alarm_kind_name((enum alarm_kind)k),
                   g->alarm_raised[k] ? 1 : 0);
}

int metrics_file_replace(const char *path, const char *text, size_t len)
{
    char *tmp = xasprintf("%s.XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        free(tmp);
        return -1;
    }
    /* mkstemp made it 0600 and ours; the exporter reading it is another user */
    int rc = 0;
    errno = 0;
    if (fchmod(fd, 0644) < 0)
        rc = -1;
    else if (write(fd, text, len) != (ssize_t)len) {
        rc = -1;
        if (errno == 0)
            errno = ENOSPC;     /* a short write to a regular file: the disk is full */
    }
    int saved = errno;
    if (close(fd) < 0 && rc == 0) {
        rc = -1;
        saved = errno;
    }
    if (rc == 0 && rename(tmp, path) < 0) {
        rc = -1;
        saved = errno;
    }
    if (rc < 0)
        unlink(tmp);
    free(tmp);
    errno = saved;
    return rc;
}

void metrics_free(struct metrics *m)
{
    while (m->tools) {
        struct metrics_tool *t = m->tools;
        m->tools = t->next;
        free(t->tool);
        free(t);
    }
}
