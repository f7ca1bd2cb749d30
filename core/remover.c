#include "remover.h"
#include "record.h"
#include "root.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#define WORKERS_MAX 2           /* the walk is disk-bound: more threads only contend */
#define RETRY_FIRST_MS 250
#define RETRY_MAX_MS 30000

struct job {
    char *state_dir;
    char *id;                   /* NULL: nothing to remove, only the uid to release */
    struct session_record *record;      /* NULL: none */
    int uid_lock_fd;
    remover_done_fn done;
    void *ud;
    bool removed;               /* the last attempt's outcome (worker -> loop) */
    int record_errno, root_errno; /* its failures, logged by the loop: the log is not
                                   * the workers' (its rate limit is unlocked state) */
    bool reported;              /* done() has run */
    unsigned attempts;
    int64_t retry_at_ms;
    struct job *next;
};

struct remover {
    struct ev_loop *loop;
    ev_async wake;              /* a worker finished an attempt */
    ev_timer retry;             /* the next failed removal is due again */
    pthread_mutex_t mu;
    pthread_cond_t work;
    /* under mu: */
    struct job *queue, **queue_tail;
    struct job *finished;
    unsigned idle;
    bool stopping;
    /* loop thread only: */
    pthread_t workers[WORKERS_MAX];
    unsigned nworkers;
    struct job *retrying;
    unsigned pending;           /* submitted, not yet gone */
    unsigned unreported;        /* each holds a reference on the loop */
};

static void job_free(struct job *j)
{
    if (j->record) {
        record_clear(j->record);
        free(j->record);
    }
    close_quietly(&j->uid_lock_fd);
    free(j->state_dir);
    free(j->id);
    free(j);
}

static bool job_attempt(struct job *j)
{
    j->record_errno = j->root_errno = 0;
    if (!j->id)
        return true;
    if (j->record && j->attempts == 0) {
        j->record->state = RECORD_CLOSING;
        if (record_write(j->state_dir, j->record, false) < 0)
            j->record_errno = errno;
    }
    if (root_remove(j->state_dir, j->id) == 0) {
        if (j->record && record_remove(j->state_dir, j->id) < 0)
            j->record_errno = errno;
        return true;
    }
    j->root_errno = errno;
    return false;
}

static void *worker_main(void *arg)
{
    struct remover *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->queue && !r->stopping) {
            r->idle++;
            pthread_cond_wait(&r->work, &r->mu);
            r->idle--;
        }
        if (!r->queue)
            break;              /* stopping, nothing queued */
        struct job *j = r->queue;
        r->queue = j->next;
        if (!r->queue)
            r->queue_tail = &r->queue;
        pthread_mutex_unlock(&r->mu);
        bool removed = job_attempt(j);
        pthread_mutex_lock(&r->mu);
        j->removed = removed;
        j->next = r->finished;
        r->finished = j;
        ev_async_send(r->loop, &r->wake);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Loop thread: hand a job to the workers, starting one if none is free. */
static void enqueue(struct remover *r, struct job *j)
{
    pthread_mutex_lock(&r->mu);
    j->next = NULL;
    *r->queue_tail = j;
    r->queue_tail = &j->next;
    bool need_worker = r->idle == 0 && r->nworkers < WORKERS_MAX;
    pthread_cond_signal(&r->work);
    pthread_mutex_unlock(&r->mu);
    if (!need_worker)
        return;
    /* Workers take no signal: the loop's signal watchers must see them all. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&r->workers[r->nworkers], NULL, worker_main, r);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0)
        r->nworkers++;
    else if (r->nworkers == 0)
        LOG_E("remover: no worker thread (%s); removals wait for one", strerror(rc));
}

static void arm_retry(struct remover *r)
{
    ev_timer_stop(r->loop, &r->retry);
    if (!r->retrying)
        return;
    int64_t first = r->retrying->retry_at_ms;
    for (struct job *j = r->retrying; j; j = j->next)
        if (j->retry_at_ms < first)
            first = j->retry_at_ms;
    int64_t wait = first - now_ms();
    ev_timer_set(&r->retry, wait > 0 ? (double)wait / 1000.0 : 0, 0);
    ev_timer_start(r->loop, &r->retry);
    ev_unref(r->loop);          /* a retry alone does not keep the server running */
}

static void on_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct remover *r = w->data;
    ev_ref(r->loop);            /* balances arm_retry's unref: the timer is stopped */
    int64_t now = now_ms();
    struct job **pp = &r->retrying;
    while (*pp) {
        struct job *j = *pp;
        if (j->retry_at_ms <= now) {
            *pp = j->next;
            enqueue(r, j);
        } else {
            pp = &j->next;
        }
    }
    arm_retry(r);
}

static void on_wake(struct ev_loop *loop, ev_async *w, int revents)
{
    (void)loop, (void)revents;
    struct remover *r = w->data;
    pthread_mutex_lock(&r->mu);
    struct job *list = r->finished;
    r->finished = NULL;
    pthread_mutex_unlock(&r->mu);
    bool retry_changed = false;
    while (list) {
        struct job *j = list;
        list = j->next;
        if (j->record_errno)
            LOG_W("session %s: record: %s", j->id, strerror(j->record_errno));
        if (j->root_errno && j->attempts == 0)
            LOG_E("session %s: could not remove all of its root yet (%s); retrying", j->id,
                  strerror(j->root_errno));
        j->attempts++;
        if (!j->reported) {
            j->reported = true;
            r->unreported--;
            ev_unref(r->loop);
            if (j->done)
                j->done(j->ud, j->removed);
        }
        if (j->removed) {
            if (j->attempts > 1)
                LOG_I("session %s: root removed after %u attempts", j->id, j->attempts);
            r->pending--;
            job_free(j);
            continue;
        }
        int64_t pause = RETRY_FIRST_MS;
        for (unsigned i = 1; i < j->attempts && pause < RETRY_MAX_MS; i++)
            pause *= 2;
        j->retry_at_ms = now_ms() + (pause < RETRY_MAX_MS ? pause : RETRY_MAX_MS);
        j->next = r->retrying;
        r->retrying = j;
        retry_changed = true;
    }
    if (retry_changed) {
        if (ev_is_active(&r->retry))
            ev_ref(r->loop);
        arm_retry(r);
    }
}

struct remover *remover_new(struct ev_loop *loop)
{
    struct remover *r = xcalloc(1, sizeof *r);
    r->loop = loop;
    r->queue_tail = &r->queue;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    ev_async_init(&r->wake, on_wake);
    r->wake.data = r;
    ev_async_start(loop, &r->wake);
    ev_unref(loop);             /* only jobs waiting for their first answer keep it */
    ev_timer_init(&r->retry, on_retry, 0, 0);
    r->retry.data = r;
    return r;
}

void remover_submit(struct remover *r, const char *state_dir, const char *id,
                    struct session_record *record, int uid_lock_fd, remover_done_fn done,
                    void *ud)
{
    struct job *j = xcalloc(1, sizeof *j);
    j->state_dir = xstrdup(state_dir);
    j->id = id ? xstrdup(id) : NULL;
    j->record = record;
    j->uid_lock_fd = uid_lock_fd;
    j->done = done;
    j->ud = ud;
    r->pending++;
    r->unreported++;
    ev_ref(r->loop);
    enqueue(r, j);
}

unsigned remover_pending(const struct remover *r) { return r ? r->pending : 0; }

void remover_free(struct remover *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    r->stopping = true;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    for (unsigned i = 0; i < r->nworkers; i++)
        pthread_join(r->workers[i], NULL);
    /* The workers are gone: what is left gets a last attempt here. */
    struct job *lists[] = {r->queue, r->finished, r->retrying};
    for (size_t k = 0; k < ARRAY_LEN(lists); k++) {
        while (lists[k]) {
            struct job *j = lists[k];
            lists[k] = j->next;
            if (!j->removed && !job_attempt(j))
                LOG_E("session %s: its root could not be removed; left on disk", j->id);
            if (!j->reported)
                ev_unref(r->loop);  /* the reference its submission took */
            job_free(j);
        }
    }
    if (ev_is_active(&r->retry)) {
        ev_ref(r->loop);
        ev_timer_stop(r->loop, &r->retry);
    }
    ev_ref(r->loop);
    ev_async_stop(r->loop, &r->wake);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->work);
    free(r);
}
