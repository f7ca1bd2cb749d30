#include "proc.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static struct ev_loop *proc_loop;
static struct proc *registry;
static ev_signal sigchld_watcher;
static unsigned long orphans_reaped;

/* Children kept on purpose (zygotes, the server's spawner): neither a call's tree nor
 * orphans, so a sweep leaves them and everything below them alone. */
static pid_t *kept;
static size_t nkept, kept_cap;

void proc_keep(pid_t pid)
{
    kept = xgrow(kept, &kept_cap, nkept, sizeof *kept, 16);
    kept[nkept++] = pid;
}

static void proc_unkeep(pid_t pid)
{
    for (size_t i = 0; i < nkept; i++)
        if (kept[i] == pid) {
            kept[i] = kept[--nkept];
            break;
        }
    if (nkept == 0) {
        free(kept);
        kept = NULL;
        kept_cap = 0;
    }
}

static bool is_kept(pid_t pid)
{
    for (size_t i = 0; i < nkept; i++)
        if (kept[i] == pid)
            return true;
    return false;
}

/* Reaped: 1; still running: 0; not ours (reaped already): -1. */
static int reap_now(pid_t pid, int pidfd)
{
    siginfo_t si;
    memset(&si, 0, sizeof si);
    int rc = pidfd >= 0 ? waitid(P_PIDFD, (id_t)pidfd, &si, WEXITED | WNOHANG)
                        : waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG);
    if (rc < 0)
        return errno == ECHILD ? -1 : 0;
    return si.si_pid != 0;
}

void proc_kill_reap(pid_t pid, int pidfd)
{
    /* Without a pidfd the pid is still ours to signal: the child is not reaped (only this
     * module reaps, and it does not know this one). */
    if (pidfd >= 0)
        pidfd_send_signal(pidfd, SIGKILL, NULL, 0);
    else
        kill(pid, SIGKILL);
    int64_t until = now_ms() + PROC_KILL_WAIT_MS;
    int state;
    int64_t left;
    while ((state = reap_now(pid, pidfd)) == 0 && (left = until - now_ms()) > 0) {
        if (pidfd >= 0) {
            struct pollfd pf = {pidfd, POLLIN, 0};
            poll(&pf, 1, (int)left);
        } else {
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        }
    }
    close_quietly(&pidfd);
    if (state != 0)
        proc_unkeep(pid);
    else if (!is_kept(pid))
        proc_keep(pid);         /* proc_reap reaps it, not as an orphan */
}

/* Killed by proc_kill_async, not reaped yet: the pid and its pidfd (for the bounded wait
 * at shutdown; never a recycled pid). */
struct dying {
    pid_t pid;
    int pidfd;
};
static struct dying *dying;
static size_t ndying, dying_cap;

static void dying_forget(pid_t pid)
{
    for (size_t i = 0; i < ndying; i++)
        if (dying[i].pid == pid) {
            close_quietly(&dying[i].pidfd);
            dying[i] = dying[--ndying];
            break;
        }
    if (ndying == 0) {
        free(dying);
        dying = NULL;
        dying_cap = 0;
    }
}

void proc_kill_async(pid_t pid, int pidfd)
{
    if (pidfd >= 0)
        pidfd_send_signal(pidfd, SIGKILL, NULL, 0);
    else
        kill(pid, SIGKILL);
    if (reap_now(pid, pidfd) != 0) {    /* gone already (or not ours) */
        close_quietly(&pidfd);
        proc_unkeep(pid);
        return;
    }
    if (!is_kept(pid))
        proc_keep(pid);                 /* proc_reap reaps it, not as an orphan */
    dying = xgrow(dying, &dying_cap, ndying, sizeof *dying, 8);
    dying[ndying++] = (struct dying){pid, pidfd};
}

/* At shutdown: what proc_kill_async killed gets a bounded wait, then is reaped. */
static void dying_reap_all(void)
{
    int64_t until = now_ms() + PROC_KILL_WAIT_MS;
    while (ndying > 0) {
        struct dying *d = &dying[ndying - 1];
        int state;
        int64_t left;
        while ((state = reap_now(d->pid, d->pidfd)) == 0 && (left = until - now_ms()) > 0) {
            struct pollfd pf = {d->pidfd, POLLIN, 0};
            if (d->pidfd >= 0)
                poll(&pf, 1, (int)left);
            else
                nanosleep(&(struct timespec){0, 1000000}, NULL);
        }
        if (state == 0)
            LOG_W("process %d did not die within %d ms of SIGKILL; left to init", (int)d->pid,
                  PROC_KILL_WAIT_MS);
        proc_unkeep(d->pid);
        dying_forget(d->pid);
    }
}

static struct proc *find(pid_t pid)
{
    for (struct proc *p = registry; p; p = p->next)
        if (p->pid == pid)
            return p;
    return NULL;
}

static void unregister(struct proc *p)
{
    for (struct proc **pp = &registry; *pp; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    }
    ev_io_stop(proc_loop, &p->exit_watcher);
    close_quietly(&p->pidfd);
    p->next = NULL;
}

/* Reap one registered child if it has exited; dispatch its callback. */
static bool reap_registered(struct proc *p)
{
    siginfo_t si;
    memset(&si, 0, sizeof si);
    int wstatus = 0;
    if (waitid(P_PIDFD, (id_t)p->pidfd, &si, WEXITED | WNOHANG) < 0) {
        /* Not our child (a shim inside a session's zygote, reaped there): a readable
         * pidfd means it has exited. */
        if (errno != ECHILD)
            return false;
    } else if (si.si_pid == 0) {
        return false;
    } else {
        wstatus = si.si_code == CLD_EXITED ? W_EXITCODE(si.si_status, 0) : si.si_status & 0x7f;
    }
    unregister(p);
    p->on_exit(p, wstatus, p->ud);   /* may free p */
    return true;
}

void proc_reap(void)
{
    for (;;) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        /* Peek first: a registered child is reaped through its pidfd so its status goes to
         * its owner; anything else is an adopted orphan. */
        if (waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 || si.si_pid == 0)
            return;
        struct proc *p = find(si.si_pid);
        if (p) {
            if (!reap_registered(p))
                return;
        } else {
            /* a zygote that died is not an orphan; its pid may come back */
            bool was_kept = is_kept(si.si_pid);
            proc_unkeep(si.si_pid);
            if (waitpid(si.si_pid, NULL, WNOHANG) > 0 && !was_kept)
                orphans_reaped++;
            dying_forget(si.si_pid);
        }
    }
}

static void on_pidfd(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    reap_registered(w->data);
}

static void on_sigchld(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop, (void)w, (void)revents;
    proc_reap();
}

void proc_init(struct ev_loop *loop)
{
    proc_loop = loop;
    /* Daemonized grandchildren whose shim is gone reparent to us, not to init. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
        LOG_W("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
    ev_signal_init(&sigchld_watcher, on_sigchld, SIGCHLD);
    ev_signal_start(loop, &sigchld_watcher);
    ev_unref(loop);     /* the SIGCHLD watcher alone must not keep the loop running */
}

void proc_shutdown(void)
{
    dying_reap_all();
    if (!proc_loop)
        return;
    ev_ref(proc_loop);
    ev_signal_stop(proc_loop, &sigchld_watcher);
    proc_loop = NULL;
}

void proc_watch(struct proc *p, pid_t pid, int pidfd, proc_exit_fn on_exit, void *ud)
{
    p->pid = pid;
    p->pidfd = pidfd;
    p->on_exit = on_exit;
    p->ud = ud;
    p->next = registry;
    registry = p;
    ev_io_init(&p->exit_watcher, on_pidfd, pidfd, EV_READ);
    p->exit_watcher.data = p;
    ev_io_start(proc_loop, &p->exit_watcher);
}

void proc_forget(struct proc *p)
{
    for (struct proc *q = registry; q; q = q->next)
        if (q == p) {
            unregister(p);
            return;
        }
}

int proc_signal(struct proc *p, int sig)
{
    if (p->pidfd < 0) {
        errno = ESRCH;
        return -1;
    }
    return pidfd_send_signal(p->pidfd, sig, NULL, 0);
}

unsigned proc_live(void)
{
    unsigned n = 0;
    for (struct proc *p = registry; p; p = p->next)
        n++;
    return n;
}

unsigned long proc_orphans_reaped(void) { return orphans_reaped; }

/* ---- walking a process tree ---------------------------------------------------------- */

struct pidset {
    pid_t *v;
    size_t n, cap;
};

static void pidset_add(struct pidset *s, pid_t pid)
{
    s->v = xgrow(s->v, &s->cap, s->n, sizeof *s->v, 64);
    s->v[s->n++] = pid;
}

static bool pidset_has(const struct pidset *s, pid_t pid)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i] == pid)
            return true;
    return false;
}

/* Append the children of every task of `pid` to `out`. */
static void read_children(pid_t pid, struct pidset *out)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] < '0' || de->d_name[0] > '9')
            continue;
        char cpath[320];
        snprintf(cpath, sizeof cpath, "/proc/%d/task/%s/children", (int)pid, de->d_name);
        FILE *f = fopen(cpath, "re");
        if (!f)
            continue;
        int child;
        while (fscanf(f, "%d", &child) == 1)
            if (child > 0 && !pidset_has(out, child))
                pidset_add(out, child);
        fclose(f);
    }
    closedir(d);
}

/* Parent pid and state letter from /proc/PID/stat (the comm field may hold spaces and
 * parentheses, so parse from the last ')'). */
static int read_stat(pid_t pid, pid_t *ppid, char *state)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *rp = strrchr(buf, ')');
    int pp;
    if (!rp || sscanf(rp + 1, " %c %d", state, &pp) != 2)
        return -1;
    *ppid = pp;
    return 0;
}

int proc_signal_descendants(pid_t root, int sig, bool skip_registered)
{
    struct pidset tree = {0}, skipped = {0};
    pidset_add(&tree, root);
    for (size_t i = 0; i < tree.n && tree.n < 100000; i++) {
        /* A registered child (a live call's shim) owns its own tree, and a kept one (a
         * zygote) holds the shims of live calls: leave them whole. */
        if (i > 0 && skip_registered && (find(tree.v[i]) || is_kept(tree.v[i])))
            pidset_add(&skipped, tree.v[i]);
        else
            read_children(tree.v[i], &tree);
    }

    int signalled = 0;
    for (size_t i = 1; i < tree.n; i++) {
        pid_t pid = tree.v[i];
        if (pidset_has(&skipped, pid))
            continue;
        int pfd = pidfd_open(pid, 0);
        if (pfd < 0)
            continue;
        pid_t ppid;
        char state;
        /* With the pidfd held the pid cannot be reused; confirm it is still ours. A
         * zombie is signalled too: it may be the leader of a thread group whose other
         * threads run (the leader exited alone), which only a signal to the group ends;
         * a plain zombie ignores it. Counted: live ones only. */
        if (read_stat(pid, &ppid, &state) == 0 && pidset_has(&tree, ppid)) {
            if (pidfd_send_signal(pfd, sig, NULL, 0) == 0 && state != 'Z') {
                signalled++;
                if (sig == SIGTERM)
                    pidfd_send_signal(pfd, SIGCONT, NULL, 0);
            }
        }
        close(pfd);
    }
    free(tree.v);
    free(skipped.v);
    return signalled;
}

int proc_sweep_orphans(void)
{
    /* Our unregistered children are orphans adopted as subreaper, and so are their trees;
     * kill the trees first so nothing re-forks while the roots die. */
    int n = proc_signal_descendants(getpid(), SIGKILL, true);
    proc_reap();
    return n;
}

size_t proc_descendants(pid_t root, pid_t *out, size_t max)
{
    struct pidset tree = {0};
    pidset_add(&tree, root);
    for (size_t i = 0; i < tree.n && tree.n < 100000; i++)
        read_children(tree.v[i], &tree);
    size_t n = tree.n - 1 < max ? tree.n - 1 : max;
    memcpy(out, tree.v + 1, n * sizeof *out);
    free(tree.v);
    return n;
}

void proc_count_tree(unsigned *live, unsigned *zombies, unsigned *owned)
{
    proc_count_tree_pids(live, zombies, owned, NULL, 0);
}

void proc_count_tree_pids(unsigned *live, unsigned *zombies, unsigned *owned, pid_t *owned_pids,
                          size_t cap)
{
    struct pidset tree = {0};
    pid_t self = getpid();
    pidset_add(&tree, self);
    for (size_t i = 0; i < tree.n && tree.n < 100000; i++)
        read_children(tree.v[i], &tree);
    *live = *zombies = 0;
    if (owned)
        *owned = 0;
    for (size_t i = 1; i < tree.n; i++) {
        pid_t ppid;
        char state;
        if (read_stat(tree.v[i], &ppid, &state) < 0)
            continue;
        if (state != 'Z') {
            (*live)++;
            continue;
        }
        (*zombies)++;
        if (owned && (ppid == self || find(ppid))) {
            if (owned_pids && *owned < cap)
                owned_pids[*owned] = tree.v[i];
            (*owned)++;
        }
    }
    free(tree.v);
}
