#ifndef STOCKADE_REMOVER_H
#define STOCKADE_REMOVER_H
/* Session roots are removed off the event loop. A tool controls how many entries its
 * root holds (tens of thousands of directories take tens of seconds to remove), so the
 * walk (root.c's root_remove) runs in worker threads, and the loop only hears when it is
 * done.
 *
 * Threads, not a process: the walk needs nothing but a path and the supervisor's own
 * rights, a thread costs no fork of a supervisor holding every client's socket, and
 * finishing is one ev_async. The walk calls nothing that takes a lock a fork would
 * leave held, except malloc and stdio, whose locks glibc's fork() takes care of.
 *
 * A job owns what the session still held beside its root: the lock fd that reserves its
 * service uid. It is closed only once the root is gone, so the uid is never handed to a
 * new session while files owned by it remain. A removal that fails is retried, with a
 * growing pause, until it succeeds (or the remover is freed). */
#include <ev.h>
#include <stdbool.h>

struct remover;

/* Called on the loop thread after the first attempt: removed is false when something
 * could not be removed yet (it is being retried). */
typedef void (*remover_done_fn)(void *ud, bool removed);

struct remover *remover_new(struct ev_loop *loop);
/* Remove STATE_DIR/sessions/ID (id NULL: nothing to remove), then close uid_lock_fd
 * (-1: none). With a record (core/record.c; the job owns it from here): it is written
 * in state "closing" first, in the worker (a crash from then on leaves a record that says
 * "remove me"), and removed after the root (a root is never left without one). done (may
 * be NULL) runs on the loop thread, never from inside this call. */
struct session_record;
void remover_submit(struct remover *r, const char *state_dir, const char *id,
                    struct session_record *record, int uid_lock_fd, remover_done_fn done,
                    void *ud);
/* Jobs not finished yet, retries included. */
unsigned remover_pending(const struct remover *r);
/* Stop retrying, wait for the walks under way, release everything. Jobs still queued
 * get one attempt each, in this thread. */
void remover_free(struct remover *r);

#endif
