#ifndef STOCKADE_PROC_H
#define STOCKADE_PROC_H
/* The one owner of child processes: it registers the supervisor's children (call shims),
 * watches their exit through pidfds, and is the only place that reaps. The supervisor is
 * a child subreaper, so orphans of a call that lost its shim land here too: they are
 * killed and reaped, never left running. Children kept on purpose (zygotes) are known
 * here too, and ended through proc_kill_async (or proc_kill_reap, which waits).
 *
 * The one exception in the supervisor: sandbox_caps_namespaces() forks a throwaway child
 * (one per namespace if that fails) to probe the kernel and waits for it itself, once,
 * when strict isolation or doctor first asks. Other processes reap their own: a shim or
 * a runner its tool's tree (spawn.c), `stockade test` its test files (testing.c). */
#include <ev.h>
#include <stdbool.h>
#include <sys/types.h>

struct proc;
typedef void (*proc_exit_fn)(struct proc *p, int wstatus, void *ud);

struct proc {
    pid_t pid;
    int pidfd;
    ev_io exit_watcher;     /* readable when the process exits */
    proc_exit_fn on_exit;
    void *ud;
    struct proc *next;      /* in the registry */
};

void proc_init(struct ev_loop *loop);
void proc_shutdown(void);
/* Take ownership of child `pid` (and of `pidfd`); on_exit runs once, after reaping. */
void proc_watch(struct proc *p, pid_t pid, int pidfd, proc_exit_fn on_exit, void *ud);
/* Stop watching a process that is not our child (a zygote's shim, reaped by the zygote)
 * once it has said what it had to: closes the pidfd; on_exit never runs. */
void proc_forget(struct proc *p);
/* Signal a registered child; never a recycled pid (pidfd_send_signal). */
int proc_signal(struct proc *p, int sig);
/* Reap whatever has exited; dispatches on_exit for registered children. */
void proc_reap(void);
/* A child the supervisor keeps on purpose (a zygote): not an orphan to sweep, and not
 * counted as one when it dies. */
void proc_keep(pid_t pid);
/* End a child of ours that nothing registered (a kept zygote, or a child whose pidfd
 * could not be opened) and reap it: SIGKILL (through `pidfd` when >= 0, which is closed
 * here), then a wait on the loop thread, bounded by PROC_KILL_WAIT_MS: a SIGKILLed process
 * only has its namespaces to tear down. Past the bound it stays kept, and proc_reap reaps
 * it when it is gone. */
#define PROC_KILL_WAIT_MS 2000
void proc_kill_reap(pid_t pid, int pidfd);
/* The same without waiting, for the loop: SIGKILL (through `pidfd`, which is ours from
 * here), and the child is reaped when it is gone (proc_reap, on its SIGCHLD; a frozen or
 * slow-to-die child costs the loop nothing). proc_shutdown waits, bounded by
 * PROC_KILL_WAIT_MS, for those still dying. */
void proc_kill_async(pid_t pid, int pidfd);
/* Kill every unregistered, unkept child of the supervisor and their trees (orphans that a
 * dead shim left behind). Returns how many processes were signalled. */
int proc_sweep_orphans(void);

unsigned proc_live(void);               /* registered children not yet reaped */
unsigned long proc_orphans_reaped(void);

/* Send `sig` to every descendant of `root` (not to root itself), found through
 * /proc/PID/task/TID/children. Each target is pinned with a pidfd and checked to still
 * be a child of a process in the tree before it is signalled, so a recycled pid is not
 * hit. Returns the number of live descendants signalled (zombies are not counted). */
int proc_signal_descendants(pid_t root, int sig, bool skip_registered);

/* The pids below `root` (not root itself), found through the children lists; at most
 * `max`. Returns how many were written to out. */
size_t proc_descendants(pid_t root, pid_t *out, size_t max);

/* Live and zombie processes below the supervisor (every call's tree, and orphans).
 * `owned` counts the zombies that are ours or a shim's to reap — a leak if they stay;
 * a zombie whose parent is a tool process is that tool's business until its tree ends. */
void proc_count_tree(unsigned *live, unsigned *zombies, unsigned *owned);
/* The same, also giving the pids of the owned zombies (at most cap of them). */
void proc_count_tree_pids(unsigned *live, unsigned *zombies, unsigned *owned, pid_t *owned_pids,
                          size_t cap);

#endif
