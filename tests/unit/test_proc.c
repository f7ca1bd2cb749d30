#include "check.h"
#include "proc.h"

#include <errno.h>
#include <signal.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t child_that_waits(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        pause();
        _exit(0);
    }
    return pid;
}

/* A kept child (a zygote) that dies is reaped, but it is not an orphan. */
static void test_dead_kept_child_is_no_orphan(void)
{
    pid_t pid = child_that_waits();
    CHECK(pid > 0);
    proc_keep(pid);
    unsigned long before = proc_orphans_reaped();
    kill(pid, SIGKILL);
    /* peek until it is a zombie, then let proc_reap take it */
    siginfo_t si = {0};
    CHECK(waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0);
    proc_reap();
    CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD);
    CHECK(proc_orphans_reaped() == before);
}

/* An unknown child that dies is an orphan. */
static void test_dead_unknown_child_is_an_orphan(void)
{
    pid_t pid = child_that_waits();
    unsigned long before = proc_orphans_reaped();
    kill(pid, SIGKILL);
    siginfo_t si = {0};
    CHECK(waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0);
    proc_reap();
    CHECK(proc_orphans_reaped() == before + 1);
}

/* proc_kill_reap ends a kept child and reaps it, with or without its pidfd. */
static void test_kill_reap(void)
{
    unsigned long before = proc_orphans_reaped();
    pid_t pid = child_that_waits();
    int pidfd = pidfd_open(pid, 0);
    CHECK(pidfd >= 0);
    proc_keep(pid);
    proc_kill_reap(pid, pidfd);
    CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD);

    pid = child_that_waits();
    proc_kill_reap(pid, -1);
    CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD);
    proc_reap();
    CHECK(proc_orphans_reaped() == before);
}

/* proc_kill_async does not wait: the child is reaped later, by proc_reap (on its
 * SIGCHLD) or at proc_shutdown (bounded), and is no orphan either way. */
static void test_kill_async(void)
{
    unsigned long before = proc_orphans_reaped();
    pid_t pid = child_that_waits();
    int pidfd = pidfd_open(pid, 0);
    CHECK(pidfd >= 0);
    proc_keep(pid);
    proc_kill_async(pid, pidfd);
    /* dead now (a zombie for proc_reap), unless it died fast enough to be reaped already */
    siginfo_t si = {0};
    CHECK(waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0 || errno == ECHILD);
    proc_reap();
    CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD);

    pid = child_that_waits();
    proc_kill_async(pid, -1);
    proc_shutdown();                /* what is still dying is waited for, then reaped */
    CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD);
    CHECK(proc_orphans_reaped() == before);
}

int main(void)
{
    test_dead_kept_child_is_no_orphan();
    test_dead_unknown_child_is_an_orphan();
    test_kill_reap();
    test_kill_async();
    return check_report("test_proc");
}
