#include "accounting.h"
#include "proc.h"

#include <dirent.h>
#include <errno.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    proc_count_tree(&s->processes, &s->zombies, &s->owned_zombies);
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "re");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
            resident = 0;
        fclose(f);
    }
    s->rss_kb = resident * (sysconf(_SC_PAGESIZE) / 1024);
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
