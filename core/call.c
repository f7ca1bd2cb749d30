#include "call.h"
#include "policy.h"
#include "session.h"
#include "zygote.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define READ_CHUNK 65536
#define READS_PER_EVENT 4       /* a flooding tool must not starve the other calls */
#define DRAIN_AFTER_EXIT_MS 2000
#define PAUSED_DRAIN_MS 60000   /* the same after exit, while the client is behind */
#define LAST_RESORT_MS 10000    /* after SIGUSR1, how long the shim gets before SIGKILL
                                 * (a loaded host can take seconds to end a fork bomb) */

static const char *const class_names[] = {
    [CLASS_OK] = "OK",
    [CLASS_TOOL_ERROR] = "TOOL_ERROR",
    [CLASS_TOOL_TIMEOUT] = "TOOL_TIMEOUT",
    [CLASS_DEADLINE_EXCEEDED] = "DEADLINE_EXCEEDED",
    [CLASS_SESSION_EXPIRED] = "SESSION_EXPIRED",
    [CLASS_POLICY_VIOLATION] = "POLICY_VIOLATION",
    [CLASS_RESOURCE_LIMIT] = "RESOURCE_LIMIT",
    [CLASS_OUTPUT_REJECTED] = "OUTPUT_REJECTED",
    [CLASS_CANCELLED] = "CANCELLED",
    [CLASS_OVERLOADED] = "OVERLOADED",
    [CLASS_BAD_REQUEST] = "BAD_REQUEST",
    [CLASS_NO_SUCH_SESSION] = "NO_SUCH_SESSION",
    [CLASS_INTERNAL] = "INTERNAL",
};

const char *call_class_name(enum call_class c)
{
    return (unsigned)c < ARRAY_LEN(class_names) ? class_names[c] : "INTERNAL";
}

void call_request_free(struct call_request *r)
{
    free(r->tool);
    for (size_t i = 0; i < r->argc; i++)
        free(r->argv[i]);
    free(r->argv);
    free(r->stdin_data);
    for (char **e = r->env; e && *e; e++)
        free(*e);
    free(r->env);
    memset(r, 0, sizeof *r);
}

static void set_result(struct call *c, enum call_class class, bool retryable, char *message,
                       const char *layer)
{
    free(c->result.message);
    c->result.class = class;
    c->result.retryable = retryable;
    c->result.message = message;
    c->result.layer = layer;
}

/* ---- answering: the one place a call's resources are let go of -------------------- */

/* A call in STARTING no longer waits for its zygote. */
static void stop_waiting(struct call *c)
{
    if (!ev_is_active(&c->start_watcher))
        return;
    ev_io_stop(c->loop, &c->start_watcher);
    zygote_wait_end(c->zygote);
}

/* A call leaves STARTING without having started: nothing waits, no timer runs; it is
 * answered next. */
static void starting_abandon(struct call *c)
{
    c->state = CALL_ACCEPTED;
    stop_waiting(c);
    ev_timer_stop(c->loop, &c->timeout_timer);
    ev_timer_stop(c->loop, &c->deadline_timer);
}

static void stop_io(struct call *c)
{
    ev_io_stop(c->loop, &c->out.watcher);
    ev_io_stop(c->loop, &c->err.watcher);
    ev_io_stop(c->loop, &c->stdin_watcher);
    ev_io_stop(c->loop, &c->report_watcher);
    stop_waiting(c);
    ev_timer_stop(c->loop, &c->timeout_timer);
    ev_timer_stop(c->loop, &c->deadline_timer);
    ev_timer_stop(c->loop, &c->grace_timer);
    ev_timer_stop(c->loop, &c->answer_timer);
    ev_timer_stop(c->loop, &c->quiet_timer);
    close_quietly(&c->out.fd);
    close_quietly(&c->err.fd);
    close_quietly(&c->child.stdin_fd);
    close_quietly(&c->child.status_fd);
}

static enum call_class class_from_name(const char *name)
{
    for (size_t i = 0; i < ARRAY_LEN(class_names); i++)
        if (strcmp(class_names[i], name) == 0)
            return (enum call_class)i;
    return CLASS_INTERNAL;
}

/* A failed tool whose last words name a limit we set: RESOURCE_LIMIT, not TOOL_ERROR.
 * The kernel tells a tool "out of memory" or "no more processes" only through errno, so
 * its message is all there is to go on. */
static void classify_limits(struct call *c)
{
    static const struct { const char *needle; const char *what; } limits[] = {
        {"Cannot allocate memory", "memory limit reached"},
        {"MemoryError", "memory limit reached"},
        {"out of memory", "memory limit reached"},
        {"Resource temporarily unavailable", "process limit reached"},
        {"Cannot fork", "process limit reached"},       /* dash */
        {"Too many open files", "open-file limit reached"},
        {"File size limit exceeded", "file size limit reached"},
    };
    struct call_result *r = &c->result;
    if (r->class != CLASS_TOOL_ERROR || !c->err.tail.len)
        return;
    for (size_t i = 0; i < ARRAY_LEN(limits); i++) {
        if (memmem(c->err.tail.data, c->err.tail.len, limits[i].needle,
                   strlen(limits[i].needle))) {
            set_result(c, CLASS_RESOURCE_LIMIT, false, xstrdup(limits[i].what), NULL);
            return;
        }
    }
}

/* With all output in: the policy's classify hook, then the declared output check. */
static void finalize(struct call *c)
{
    struct call_result *r = &c->result;
    classify_limits(c);
    struct policy_classify_input in = {
        .has_exit_code = r->has_exit_code, .exit_code = r->exit_code, .signal = r->signal,
        .layer = r->layer,
        .stdout_tail = c->out.tail.data ? c->out.tail.data : "", .stdout_tail_len = c->out.tail.len,
        .stderr_tail = c->err.tail.data ? c->err.tail.data : "", .stderr_tail_len = c->err.tail.len,
        .duration_ms = now_ms() - c->started_ms,
    };
    char *class = NULL, *message = NULL;
    bool retryable = false;
    if (policy_classify(c->policy, c->tool, &in, &class, &retryable, &message)) {
        enum call_class k = class_from_name(class);
        /* OK only for a tool that exited 0: a hook cannot turn a crash into success */
        if (k != CLASS_OK || (r->has_exit_code && r->exit_code == 0))
            set_result(c, k, retryable,
                       message ? message : xasprintf("classified %s by the policy", class),
                       r->layer);
        else
            free(message);
        free(class);
    }
    if (r->class == CLASS_OK && c->tool->has_output_check) {
        char *why = NULL;
        if (r->truncated_out > 0)
            set_result(c, CLASS_OUTPUT_REJECTED, false,
                       xstrdup("output was truncated, so it cannot be checked"), NULL);
        else if (!policy_check_output(c->policy, c->tool, r->out.data ? r->out.data : "",
                                      r->out.len, &why))
            set_result(c, CLASS_OUTPUT_REJECTED, false, why, NULL);
    }
}

static void answer(struct call *c)
{
    if (c->state == CALL_ANSWERED)
        return;
    if (c->ran)
        finalize(c);
    stop_io(c);
    c->state = CALL_ANSWERED;
    c->result.duration_ms = now_ms() - c->started_ms;
    c->on_done(c, c->ud);
}

static void on_answer_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    if (c->state == CALL_REAPED && c->kill_class == CLASS_OK)
        LOG_W("call %s: output still open %d ms after the tree ended; closing it",
              c->req.tool, c->paused ? PAUSED_DRAIN_MS : DRAIN_AFTER_EXIT_MS);
    answer(c);
}

/* A call that never ran: answered from the loop, like every other. */
static struct call *refuse(struct call *c, enum call_class class, char *message,
                           const char *layer)
{
    set_result(c, class, class == CLASS_OVERLOADED, message, layer);
    ev_timer_set(&c->answer_timer, 0, 0);
    ev_timer_start(c->loop, &c->answer_timer);
    return c;
}

/* After the tree ended, the output still open gets a bounded time to drain: longer while
 * the client is behind (we are not reading it), but never unbounded. Repeating, so that
 * ev_timer_again restarts the window when output moves. */
static void arm_drain_guard(struct call *c)
{
    double s = (c->paused ? PAUSED_DRAIN_MS : DRAIN_AFTER_EXIT_MS) / 1000.0;
    ev_timer_stop(c->loop, &c->answer_timer);
    ev_timer_set(&c->answer_timer, s, s);
    ev_timer_start(c->loop, &c->answer_timer);
}

static void maybe_answer(struct call *c)
{
    if (c->shim_reaped && c->out.eof && c->err.eof)
        answer(c);
}

/* ---- output ------------------------------------------------------------------------ */

#define TAIL_MAX 4096              /* what classify hooks see of each stream's end */

/* Redacted bytes reach the result (capped), the tail for classify, and the stream. */
static void deliver(struct call *c, enum call_stream s, const char *data, size_t n)
{
    if (n == 0)
        return;
    struct call_stream_state *st = s == CALL_STDOUT ? &c->out : &c->err;
    struct buf *b = s == CALL_STDOUT ? &c->result.out : &c->result.err;
    int64_t *dropped = s == CALL_STDOUT ? &c->result.truncated_out : &c->result.truncated_err;
    size_t cap = (size_t)c->policy->limits.output;
    size_t keep = b->len >= cap ? 0 : cap - b->len < n ? cap - b->len : n;
    if (keep)
        buf_append(b, data, keep);
    *dropped += (int64_t)(n - keep);
    if (n >= TAIL_MAX) {
        st->tail.len = 0;
        buf_append(&st->tail, data + n - TAIL_MAX, TAIL_MAX);
    } else {
        if (st->tail.len + n > TAIL_MAX) {
            size_t drop = st->tail.len + n - TAIL_MAX;
            memmove(st->tail.data, st->tail.data + drop, st->tail.len - drop);
            st->tail.len -= drop;
        }
        buf_append(&st->tail, data, n);
    }
    /* A stream carries everything; only the final result is capped. The client's
     * back-pressure (call_pause_output) keeps this from growing without bound. */
    if (c->req.stream && c->on_output)
        c->on_output(c, s, data, n, c->ud);
}

struct deliver_target {
    struct call *call;
    enum call_stream stream;
};

static void deliver_sink(void *ud, const char *data, size_t n)
{
    struct deliver_target *t = ud;
    deliver(t->call, t->stream, data, n);
}

/* Bytes (or the end) of one stream through the tool's redaction chain, then onwards. */
static void redact_feed(struct call *c, enum call_stream s, const char *data, size_t n,
                        enum redact_mode mode)
{
    struct call_stream_state *st = s == CALL_STDOUT ? &c->out : &c->err;
    struct deliver_target target = {c, s};
    policy_redact_feed(c->policy, c->tool, s == CALL_STDOUT ? "stdout" : "stderr",
                       c->session->id, &st->redact, data, n, mode, &c->result.redactions,
                       deliver_sink, &target);
}

#define REDACT_QUIET_MS 100

static void capture(struct call *c, enum call_stream s, const char *data, size_t n)
{
    if (!c->tool->redact_active) {
        deliver(c, s, data, n);
        return;
    }
    redact_feed(c, s, data, n, REDACT_MORE);
    /* Once the tool has been quiet a moment, what redaction holds back goes out, up to
     * the first place a secret could begin: a streamed prompt or progress line is not
     * stuck behind a window that never fills, and a secret split by a pause still is. */
    if (redact_stream_held(&c->out.redact) || redact_stream_held(&c->err.redact))
        ev_timer_again(c->loop, &c->quiet_timer);
}

static void on_quiet(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    ev_timer_stop(c->loop, w);
    if (redact_stream_held(&c->out.redact))
        redact_feed(c, CALL_STDOUT, NULL, 0, REDACT_QUIET);
    if (redact_stream_held(&c->err.redact))
        redact_feed(c, CALL_STDERR, NULL, 0, REDACT_QUIET);
}

/* Read what one stream holds, at most READS_PER_EVENT chunks (a flooding tool must not
 * starve the other calls). True once it has ended: EOF (or a broken pipe, which is the
 * same to us), or, with `reaped`, nothing left to read: the shim's report says every
 * process of the tree is gone, and the shim, which still holds the write end until just
 * after its report, writes nothing. */
static bool stream_read(struct call *c, struct call_stream_state *st, bool reaped)
{
    bool is_out = st == &c->out;
    char chunk[READ_CHUNK];
    for (int i = 0; i < READS_PER_EVENT; i++) {
        ssize_t n = read(st->fd, chunk, sizeof chunk);
        if (n > 0) {
            capture(c, is_out ? CALL_STDOUT : CALL_STDERR, chunk, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR)
            return false;
        if (n < 0 && errno == EAGAIN && !reaped)
            return false;
        /* the end: what was held goes now */
        if (c->tool->redact_active)
            redact_feed(c, is_out ? CALL_STDOUT : CALL_STDERR, NULL, 0, REDACT_EOF);
        ev_io_stop(c->loop, &st->watcher);
        close_quietly(&st->fd);
        st->eof = true;
        return true;
    }
    return false;
}

static void on_readable(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    if (stream_read(c, w == &c->out.watcher ? &c->out : &c->err, false))
        maybe_answer(c);
}

static void on_stdin_writable(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    while (c->stdin_off < c->req.stdin_len) {
        ssize_t n = write(c->child.stdin_fd, c->req.stdin_data + c->stdin_off,
                          c->req.stdin_len - c->stdin_off);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n <= 0)
            break;      /* EPIPE: the tool does not want the rest */
        c->stdin_off += (size_t)n;
    }
    ev_io_stop(c->loop, w);
    close_quietly(&c->child.stdin_fd);
}

/* ---- ending the tree --------------------------------------------------------------- */

static void on_grace(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    if (c->state != CALL_TERMINATING)
        return;
    if (c->kill_class != CLASS_OK && !c->shim_reaped) {
        if (w->repeat == 0) {
            /* Grace is over: the shim SIGKILLs the whole tree, then reports. */
            proc_signal(&c->proc, SIGUSR1);
            ev_timer_set(w, LAST_RESORT_MS / 1000.0, LAST_RESORT_MS / 1000.0);
            ev_timer_start(c->loop, w);
        } else {
            /* The shim itself did not finish: kill it; what it leaves is ours to sweep. */
            LOG_E("call %s: shim %d unresponsive; killing it", c->req.tool, (int)c->proc.pid);
            proc_signal(&c->proc, SIGKILL);
            ev_timer_stop(c->loop, w);
        }
    }
}

void call_stop(struct call *c, enum call_class class, const char *layer, const char *why,
               bool hard)
{
    if (c->state == CALL_ANSWERED || c->state == CALL_ACCEPTED)
        return;
    if (c->state == CALL_STARTING) {
        /* nothing started: answered as a call that never ran */
        starting_abandon(c);
        refuse(c, class,
               xstrdup(why ? why : class == CLASS_CANCELLED ? "cancelled before it started"
                           : "ran out of time waiting for the session's sandbox to be ready"),
               layer);
        return;
    }
    if (c->paused) {
        /* Nobody will read a stream of what is left: the pipes are drained into the
         * (capped) result only, so the tree's end is seen. */
        c->req.stream = false;
        call_pause_output(c, false);
    }
    if (c->state == CALL_REAPED) {
        /* The tree has ended on its own; only its output was still awaited. Answered
         * from the loop: the caller may be walking the list this call is on. */
        c->kill_class = c->kill_class == CLASS_OK ? class : c->kill_class;
        ev_timer_stop(c->loop, &c->answer_timer);
        ev_timer_set(&c->answer_timer, 0, 0);
        ev_timer_start(c->loop, &c->answer_timer);
        return;
    }
    if (c->kill_class == CLASS_OK) {
        c->kill_class = class;
        c->kill_layer = layer;
        c->kill_why = why;
    }
    ev_timer_stop(c->loop, &c->timeout_timer);
    ev_timer_stop(c->loop, &c->deadline_timer);
    if (c->state == CALL_RUNNING && !hard) {
        c->state = CALL_TERMINATING;
        proc_signal(&c->proc, SIGTERM);
        ev_timer_set(&c->grace_timer, (double)c->policy->timeouts.grace_ms / 1000.0, 0);
        ev_timer_start(c->loop, &c->grace_timer);
        return;
    }
    c->state = CALL_TERMINATING;
    ev_timer_stop(c->loop, &c->grace_timer);
    ev_timer_set(&c->grace_timer, 0, 0);
    on_grace(c->loop, &c->grace_timer, 0);
}

static bool tree_ended(struct call *c);

static void on_timeout(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    if (tree_ended(w->data))
        return;
    call_stop(w->data, CLASS_TOOL_TIMEOUT, "timeout", NULL, false);
}

static void on_deadline(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    if (tree_ended(w->data))
        return;
    /* Hard: the caller's budget is spent, there is no time for a grace period. */
    call_stop(w->data, CLASS_DEADLINE_EXCEEDED, "deadline", NULL, true);
}

/* ---- the tree has ended ------------------------------------------------------------ */

static const char *signal_name(int sig)
{
    const char *n = sigabbrev_np(sig);
    return n ? n : "?";
}

static void classify(struct call *c, const struct shim_report *rep)
{
    struct call_result *r = &c->result;
    if (rep->outcome == SHIM_EXEC_FAILED) {
        set_result(c, CLASS_INTERNAL, false,
                   xasprintf("could not start %s: %s", c->tool->path, strerror(rep->err)), NULL);
        return;
    }
    if (rep->outcome == SHIM_CWD_REFUSED) {
        /* an earlier call replaced the workspace: nothing of this session is trusted */
        LOG_E("session %s: workspace refused as the tool's cwd: %s", c->session->id,
              strerror(rep->err));
        set_result(c, CLASS_INTERNAL, false,
                   xasprintf("the session's workspace is no longer the directory the session "
                             "created (%s): refused", strerror(rep->err)), NULL);
        return;
    }
    if (rep->outcome == SHIM_FORK_FAILED) {
        set_result(c, CLASS_RESOURCE_LIMIT, false,
                   xasprintf("could not fork the tool: %s", strerror(rep->err)), NULL);
        return;
    }
    int ws = rep->wstatus;
    if (WIFEXITED(ws)) {
        r->has_exit_code = true;
        r->exit_code = WEXITSTATUS(ws);
    } else if (WIFSIGNALED(ws)) {
        r->signal = WTERMSIG(ws);
    }
    r->cpu_ms = rep->cpu_us / 1000;
    r->max_rss_kb = rep->max_rss_kb;

    if (c->kill_class != CLASS_OK) {
        int64_t ran = now_ms() - c->started_ms;
        char *msg;
        switch (c->kill_class) {
        case CLASS_TOOL_TIMEOUT:
            msg = xasprintf("timed out after %lld ms; the process tree was stopped",
                            (long long)c->timeout_ms);
            break;
        case CLASS_DEADLINE_EXCEEDED:
            msg = xasprintf("the caller's deadline ran out after %lld ms", (long long)ran);
            break;
        case CLASS_CANCELLED:
            msg = xstrdup("cancelled by the client");
            break;
        case CLASS_SESSION_EXPIRED:
            msg = xasprintf("the session ended (%s)", c->kill_layer ? c->kill_layer : "closed");
            break;
        default:
            msg = xstrdup("stopped by the supervisor");
        }
        if (c->kill_why) {
            free(msg);
            msg = xstrdup(c->kill_why);
        }
        set_result(c, c->kill_class, c->kill_class == CLASS_TOOL_TIMEOUT && c->idempotent, msg,
                   c->kill_layer);
        return;
    }
    if (rep->killed_for == SHIM_KILLED_MEMORY || rep->killed_for == SHIM_KILLED_PROCESSES) {
        struct spawn_limits l = call_spawn_limits(c->policy, c->tool);
        set_result(c, CLASS_RESOURCE_LIMIT, false,
                   rep->killed_for == SHIM_KILLED_MEMORY
                       ? xasprintf("the call's processes together went over the memory "
                                   "limit of %lld MiB", (long long)(l.memory >> 20))
                       : xasprintf("the call went over its limit of %lld processes",
                                   (long long)l.processes),
                   NULL);
        return;
    }
    if (rep->killed_for == SHIM_KILLED_DISK || rep->killed_for == SHIM_KILLED_INODES) {
        bool disk = rep->killed_for == SHIM_KILLED_DISK;
        set_result(c, CLASS_RESOURCE_LIMIT, false,
                   disk ? xasprintf("the session's files went over the disk limit of %lld MiB",
                                    (long long)(c->policy->limits.disk >> 20))
                        : xasprintf("the session's files went over the inode limit of %lld",
                                    (long long)c->policy->limits.inodes),
                   NULL);
        return;
    }
    int64_t cpu_limit_ms = c->policy->timeouts.cpu_ms;
    if (r->signal == SIGXCPU || (r->signal == SIGKILL && cpu_limit_ms > 0 &&
                                 r->cpu_ms >= cpu_limit_ms)) {
        set_result(c, CLASS_TOOL_TIMEOUT, c->idempotent,
                   xasprintf("CPU time limit of %lld ms reached", (long long)cpu_limit_ms), "cpu");
    } else if (r->signal == SIGXFSZ) {
        set_result(c, CLASS_RESOURCE_LIMIT, false, xstrdup("file size limit reached"), NULL);
    } else if (r->has_exit_code && r->exit_code == 0) {
        set_result(c, CLASS_OK, false, xstrdup("ok"), NULL);
    } else if (r->has_exit_code) {
        set_result(c, CLASS_TOOL_ERROR, false, xasprintf("exited with status %d", r->exit_code),
                   NULL);
    } else if (r->signal == SIGKILL && c->zygote && !zygote_alive(c->zygote)) {
        /* the helper that started it died, and took the tool with it: not the tool's doing */
        set_result(c, CLASS_INTERNAL, c->idempotent,
                   xstrdup("the process that started the call died; the tool was killed with it"),
                   NULL);
    } else {
        set_result(c, CLASS_TOOL_ERROR, false,
                   xasprintf("killed by signal %d (SIG%s)", r->signal, signal_name(r->signal)),
                   NULL);
    }
}

/* The tree has ended: with the shim's report (rep), or without one (the shim itself was
 * killed; wstatus is its status). */
static void shim_done(struct call *c, const struct shim_report *rep, int wstatus)
{
    c->shim_reaped = true;
    ev_timer_stop(c->loop, &c->timeout_timer);
    ev_timer_stop(c->loop, &c->deadline_timer);
    ev_timer_stop(c->loop, &c->grace_timer);
    ev_io_stop(c->loop, &c->report_watcher);
    close_quietly(&c->child.status_fd);
    bool on_runner = c->runner.sp.pid > 0;
    if (on_runner && !rep && c->runner.successor_asked)
        zygote_spare_lost(c->zygote);
    /* back to the session's pool, ready for its next call; or ended: without a report,
     * or when its zygote is gone (it ends as soon as it sees that, after its report) */
    zygote_runner_done(c->session->runners, &c->runner,
                       rep != NULL && zygote_alive(c->zygote));
    if (!rep) {
        if (!on_runner)
            zygote_spare_lost(c->zygote);   /* it may have died before asking for a successor */
        /* Only a killed shim reports nothing; its orphans are now ours to end. */
        int swept = proc_sweep_orphans();
        if (c->kill_class != CLASS_OK) {
            /* we were ending it anyway (timeout, deadline, cancel): that is the answer */
            set_result(c, c->kill_class, c->kill_class == CLASS_TOOL_TIMEOUT && c->idempotent,
                       xasprintf("%s; the process tree was killed outright (%d leftover "
                                 "processes)", c->kill_class == CLASS_TOOL_TIMEOUT
                                     ? "timed out" : "stopped", swept), c->kill_layer);
        } else {
            /* nothing of it ran to an end the caller saw: safe to repeat if idempotent */
            set_result(c, CLASS_INTERNAL, c->idempotent,
                       xasprintf("the call's supervisor process died (status %#x); %d leftover "
                                 "processes killed", (unsigned)wstatus, swept), NULL);
        }
    } else {
        classify(c, rep);
        c->ran = rep->outcome == SHIM_EXITED && c->kill_class == CLASS_OK;
        if (rep->swept > 0)
            LOG_D("call %s: %d background processes outlived the tool and were killed",
                  c->req.tool, rep->swept);
    }
    c->state = CALL_REAPED;
    /* With the report, what the output pipes hold is all there will be: read it now
     * rather than wait for their EOF, one more wake-up (unless the client is behind:
     * then the watchers take it as it reads) */
    struct call_stream_state *streams[] = {&c->out, &c->err};
    for (size_t i = 0; rep && !c->paused && i < ARRAY_LEN(streams); i++)
        if (!streams[i]->eof)
            stream_read(c, streams[i], true);
    if (c->out.eof && c->err.eof) {
        answer(c);
        return;
    }
    arm_drain_guard(c);
}

static bool read_report(struct call *c, struct shim_report *rep)
{
    ssize_t n = read(c->child.status_fd, rep, sizeof *rep);
    if (n != (ssize_t)sizeof *rep || rep->magic != SHIM_REPORT_MAGIC) {
        if (n >= 0)
            errno = EPIPE;          /* closed, or not a report: no EAGAIN to wait on */
        return false;
    }
    return true;
}

static void on_shim_exit(struct proc *p, int wstatus, void *ud)
{
    (void)p;
    struct call *c = ud;
    if (!c->have_report)
        c->have_report = read_report(c, &c->report);
    shim_done(c, c->have_report ? &c->report : NULL, wstatus);
}

/* A timer fired: had the tree already ended? After the loop was held up (a stopped
 * supervisor, a long callback) a timer and the tree's end are processed in the same
 * turn, timers first; a tool that finished in time must not be reported as timed out.
 * The shim writes its report once the whole tree is reaped, so a report waiting is the
 * proof. A zygote's call ends on it now; a direct child's on its exit, just behind. */
static bool tree_ended(struct call *c)
{
    if (!c->have_report && c->child.status_fd >= 0) {
        struct pollfd pf = {c->child.status_fd, POLLIN, 0};
        if (poll(&pf, 1, 0) == 1 && (pf.revents & POLLIN))
            c->have_report = read_report(c, &c->report);
    }
    if (!c->have_report)
        return false;
    if (c->zygote) {
        proc_forget(&c->proc);
        shim_done(c, &c->report, 0);
    }
    return true;
}

/* A zygote's shim writes its report after the last process of its tree is reaped, and
 * the zygote reaps the shim: the answer need not wait for the shim's own exit. */
static void on_report(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)revents;
    struct call *c = w->data;
    struct shim_report rep;
    if (read_report(c, &rep)) {
        proc_forget(&c->proc);
        shim_done(c, &rep, 0);
    } else if (errno != EAGAIN && errno != EINTR) {
        ev_io_stop(loop, w);        /* no report: the shim's exit (pidfd) tells the rest */
    }
}

/* ---- starting ---------------------------------------------------------------------- */

static char **build_env(const struct call *c, int64_t depth)
{
    const struct session *s = c->session;
    size_t extra = 0;
    for (char **e = c->req.env; e && *e; e++)
        extra++;
    char **env = xcalloc(9 + extra, sizeof *env);
    size_t n = 0;
    /* first: getenv() takes the first of two, so an allowed LANG overrides ours below */
    for (char **e = c->req.env; e && *e; e++)       /* checked by policy_env_allowed */
        env[n++] = xstrdup(*e);
    env[n++] = xasprintf("SESSION_ID=%s", s->id);
    env[n++] = xasprintf("AGENT_ROOT=%s", s->root);
    env[n++] = xasprintf("HOME=%s/home", s->root);
    env[n++] = xasprintf("TMPDIR=%s/tmp", s->root);
    env[n++] = xasprintf("XDG_CACHE_HOME=%s/cache", s->root);
    env[n++] = xasprintf("PATH=%s", c->policy->env_path);
    env[n++] = xstrdup("LANG=C.UTF-8");
    env[n++] = xasprintf("STOCKADE_DEPTH=%lld", (long long)(depth - 1));
    env[n] = NULL;
    return env;
}

bool call_decide(struct policy *policy, const char *session_id, const char *session_root,
                 struct call_request *req, struct call_decision *d)
{
    memset(d, 0, sizeof *d);
    d->class = CLASS_POLICY_VIOLATION;
    const struct policy_limits *lim = &policy->limits;
    const struct tool_def *tool = policy_tool(policy, req->tool);
    if (!tool) {
        d->message = xasprintf("unknown tool '%.64s': not in the policy's registry", req->tool);
        return false;
    }
    d->tool = tool;
    if ((int64_t)req->stdin_len > lim->stdin_bytes) {
        d->message = xasprintf("stdin of %zu bytes is above the policy's limit of %lld",
                               req->stdin_len, (long long)lim->stdin_bytes);
        return false;
    }
    int64_t depth = req->depth < 0 ? lim->depth : req->depth;
    if (depth <= 0) {
        d->message = xstrdup("tool-call depth exhausted: nested calls are not allowed here");
        return false;
    }
    d->depth = depth;
    if (req->has_deadline &&
        (req->deadline_ms <= 0 || req->deadline_ms < policy->timeouts.deadline_min_ms)) {
        d->class = CLASS_DEADLINE_EXCEEDED;
        d->layer = "deadline";
        if (req->deadline_ms <= 0)
            d->message = xasprintf("deadline of %lld ms: the caller's budget is already spent",
                                   (long long)req->deadline_ms);
        else
            d->message = xasprintf("deadline of %lld ms is below the policy's minimum of %lld ms",
                                   (long long)req->deadline_ms,
                                   (long long)policy->timeouts.deadline_min_ms);
        return false;
    }
    struct policy_call_view view = {req->tool, req->argv, req->argc, session_id, session_root,
                                    depth};
    if (req->args) {
        char **argv = NULL, *why = NULL;
        size_t argc = 0;
        bool ok = policy_argv(policy, tool, req->args, &view, &argv, &argc, &why);
        req->args = NULL;               /* borrowed: not valid past this call */
        if (!ok) {
            d->message = why;
            return false;
        }
        for (size_t i = 0; i < req->argc; i++)
            free(req->argv[i]);
        free(req->argv);
        req->argv = argv;
        req->argc = argc;
        view.argv = argv;
        view.argc = argc;
    } else if (tool->has_argv && !tool->raw_argv) {
        /* the argv hook (and the schema before it) is the only way to this tool's
         * command line: a raw argv would skip both */
        d->message = xasprintf("tool %s takes structured args (its argv hook builds the "
                               "command line); raw argv is refused", tool->name);
        return false;
    }
    size_t argv_bytes = 0;
    for (size_t i = 0; i < req->argc; i++)
        argv_bytes += strlen(req->argv[i]) + 1;
    if ((int64_t)req->argc > lim->argv || (int64_t)argv_bytes > lim->argv_bytes) {
        d->message = xasprintf("argv too large (%zu arguments, %zu bytes; the policy allows "
                               "%lld and %lld)", req->argc, argv_bytes, (long long)lim->argv,
                               (long long)lim->argv_bytes);
        return false;
    }
    for (char **e = req->env; e && *e; e++) {
        if (!policy_env_allowed(policy, tool, *e, &d->message))
            return false;
    }
    char *reason = NULL;
    if (!policy_accept(policy, tool, &view, &reason)) {
        d->message = reason;
        return false;
    }
    d->idempotent = policy_idempotent(policy, tool, &view, req->idempotent_hint);
    d->class = CLASS_OK;
    return true;
}

static const char *const strict_tmp_paths[] = {"/tmp", "/var/tmp", NULL};

/* The tool's own limits where it sets them, the policy's elsewhere. */
struct spawn_limits call_spawn_limits(const struct policy *policy, const struct tool_def *t)
{
    const struct policy_limits *p = &policy->limits;
    const struct tool_limits *o = &t->limits;
    return (struct spawn_limits){
        .cpu_s = (policy->timeouts.cpu_ms + 999) / 1000,
        .memory = o->memory > 0 ? o->memory : p->memory,
        .address_space = o->address_space > 0 ? o->address_space : p->address_space,
        .file_size = o->file_size > 0 ? o->file_size : p->file_size,
        .open_files = o->open_files > 0 ? o->open_files : p->open_files,
        .processes = o->processes > 0 ? o->processes : p->processes,
        .disk = p->disk,            /* per session root: the policy's alone */
        .inodes = p->inodes,
    };
}

static void on_start_ready(struct ev_loop *loop, ev_io *w, int revents);

/* A call in CALL_ACCEPTED: owns *req (emptied), its timers set up, nothing started. */
static struct call *call_new(struct ev_loop *loop, struct policy *policy,
                             struct session *session, struct call_request *req,
                             call_done_fn on_done, call_output_fn on_output, void *ud)
{
    struct call *c = xcalloc(1, sizeof *c);
    c->loop = loop;
    c->policy = policy_ref(policy);
    c->session = session;
    c->req = *req;
    memset(req, 0, sizeof *req);
    c->on_done = on_done;
    c->on_output = on_output;
    c->ud = ud;
    c->started_ms = now_ms();
    c->out.fd = c->err.fd = -1;
    c->child = (struct spawn_child){.stdin_fd = -1, .stdout_fd = -1, .stderr_fd = -1,
                                    .status_fd = -1, .pidfd = -1};
    c->runner.sp = (struct zyg_spare){-1, -1, -1};
    ev_io_init(&c->start_watcher, on_start_ready, -1, EV_READ);
    c->start_watcher.data = c;
    ev_timer_init(&c->answer_timer, on_answer_timer, 0, 0);
    ev_timer_init(&c->timeout_timer, on_timeout, 0, 0);
    ev_timer_init(&c->deadline_timer, on_deadline, 0, 0);
    ev_timer_init(&c->grace_timer, on_grace, 0, 0);
    ev_timer_init(&c->quiet_timer, on_quiet, 0, REDACT_QUIET_MS / 1000.0);
    c->answer_timer.data = c->timeout_timer.data = c->deadline_timer.data = c;
    c->grace_timer.data = c->quiet_timer.data = c;
    return c;
}

/* The tool's timeout, the request's if shorter, never above the policy's maximum. */
static int64_t call_timeout(const struct call *c)
{
    const struct policy_timeouts *to = &c->policy->timeouts;
    int64_t timeout = c->tool->timeout_ms > 0 ? c->tool->timeout_ms : to->call_ms;
    if (c->req.timeout_ms > 0 && c->req.timeout_ms < timeout)
        timeout = c->req.timeout_ms;
    if (to->call_max_ms > 0 && timeout > to->call_max_ms)
        timeout = to->call_max_ms;
    return timeout;
}

/* Start the shim and the tool (c->child). 0, or -1 with errno. */
static int call_spawn(struct call *c, int64_t depth)
{
    const struct policy *policy = c->policy;
    struct session *session = c->session;
    char **argv = xcalloc(c->req.argc + 2, sizeof *argv);
    argv[0] = c->tool->path;
    for (size_t i = 0; i < c->req.argc; i++)
        argv[i + 1] = c->req.argv[i];
    char **envp = build_env(c, depth);
    char *cwd = xasprintf("%s/workspace", session->root);
    struct spawn_req sr = {
        .path = c->tool->path,
        .argv = argv,
        .envp = envp,
        .cwd = cwd,
        .cwd_dev = session->workspace_dev,
        .cwd_ino = session->workspace_ino,
        .drop_user = session->drop_user,
        .uid = session->uid,
        .gid = session->gid,
        .limits = call_spawn_limits(policy, c->tool),
        .with_stdin = c->req.stdin_len > 0,
        .landlock = true,
        .seccomp = true,
        .walls = (session->net_closed ? SANDBOX_NET_CLOSED : 0) |
                 (session->zygote ? 0 : SANDBOX_HOST_SHARED),
        .session_root = session->root,
        /* inside a zygote /tmp and /var/tmp are binds of the session's tmp, which
         * Landlock sees as paths of their own */
        .rw_paths = session->zygote ? strict_tmp_paths : NULL,
        .landlock_fd = -1,
    };
    /* Process isolation: the tool restricts itself to the session's ruleset (-1: it
     * builds its own, and says why it cannot). */
    if (!session->zygote)
        sr.landlock_fd = session->landlock_fd;
    /* Strict: the session's zygote or nothing. Process: the server's spawner (calls
     * without a fork on their path) while it lives, else a fork from here. */
    struct zygote *z = session->zygote;
    if (!z && session->spawner && !session->spawner->broken)
        z = session->spawner;
    int rc = !z ? spawn_start(&sr, &c->child)
             : zygote_runners_enabled() ? zygote_run(z, &session->runners, &sr, &c->child,
                                                     &c->runner)
                                        : zygote_spawn(z, &sr, &c->child);
    if (rc == 0)
        c->zygote = z;
    else if (z && z == session->spawner)
        rc = spawn_start(&sr, &c->child);       /* no spare ready: fork one here */
    int e = errno;
    free(argv);
    strv_free(envp);
    free(cwd);
    errno = e;
    return rc;
}

/* The timeout and the deadline, less the `spent` ms a wait to start took of them: the
 * timeout counts from the call's start, not its tool's, so a wait for the zygote does
 * not add a second timeout to it. */
static void call_timers_start(struct call *c, int64_t spent)
{
    int64_t left = c->timeout_ms - spent;
    ev_timer_set(&c->timeout_timer, (double)(left > 0 ? left : 0) / 1000.0, 0);
    ev_timer_start(c->loop, &c->timeout_timer);
    if (c->req.deadline_ms > 0) {
        /* Fire a little early: the hard kill and the answer take a few ms, and the
         * caller must never get an answer after its deadline. */
        int64_t margin = c->req.deadline_ms / 10 < 25 ? c->req.deadline_ms / 10 : 25;
        left = c->req.deadline_ms - margin - spent;
        ev_timer_set(&c->deadline_timer, (double)(left > 0 ? left : 0) / 1000.0, 0);
        ev_timer_start(c->loop, &c->deadline_timer);
    }
}

/* The call runs: its shim is watched, its pipes read and written, its clocks started. */
static void call_arm(struct call *c)
{
    struct ev_loop *loop = c->loop;
    /* The hooks and the spawn (and whatever the loop did before this call in the same
     * turn) took time: the timers below are measured from now, not from the turn's start. */
    ev_now_update(loop);
    c->state = CALL_RUNNING;
    proc_watch(&c->proc, c->child.pid, c->child.pidfd, on_shim_exit, c);
    c->child.pidfd = -1;                 /* owned by c->proc now */
    if (c->zygote) {
        ev_io_init(&c->report_watcher, on_report, c->child.status_fd, EV_READ);
        c->report_watcher.data = c;
        ev_io_start(loop, &c->report_watcher);
    }
    c->out.fd = c->child.stdout_fd;
    c->err.fd = c->child.stderr_fd;
    ev_io_init(&c->out.watcher, on_readable, c->out.fd, EV_READ);
    ev_io_init(&c->err.watcher, on_readable, c->err.fd, EV_READ);
    c->out.watcher.data = c->err.watcher.data = c;
    ev_io_start(loop, &c->out.watcher);
    ev_io_start(loop, &c->err.watcher);
    if (c->child.stdin_fd >= 0) {
        ev_io_init(&c->stdin_watcher, on_stdin_writable, c->child.stdin_fd, EV_WRITE);
        c->stdin_watcher.data = c;
        ev_io_start(loop, &c->stdin_watcher);
    }
    if (c->paused) {                    /* paused while it waited to start */
        ev_io_stop(loop, &c->out.watcher);
        ev_io_stop(loop, &c->err.watcher);
    }
    ev_timer_stop(loop, &c->timeout_timer);     /* armed while it waited to start */
    ev_timer_stop(loop, &c->deadline_timer);
    call_timers_start(c, c->waited_ms);
}

/* The session's zygote has no spare ready, or is still building its world: the call
 * waits for it on the loop (its timeout and deadline running), the loop does not. The
 * call refers to the zygote meanwhile, so that its owner keeps it (and its socket, which
 * every call waiting for it watches; only its calls take spares off it) until then. */
static void call_wait_start(struct call *c)
{
    c->zygote = c->session->zygote;
    zygote_wait_begin(c->zygote);
    ev_io_set(&c->start_watcher, zygote_wait_fd(c->zygote), EV_READ);
    ev_io_start(c->loop, &c->start_watcher);
    if (c->state != CALL_STARTING) {
        c->state = CALL_STARTING;
        ev_now_update(c->loop);
        call_timers_start(c, now_ms() - c->started_ms);
    }
}

static void call_start_failed(struct call *c, int e)
{
    /* the server short of descriptors or memory: passes, so retryable, not a bug */
    bool shortage = e == EMFILE || e == ENFILE || e == ENOMEM;
    refuse(c, shortage ? CLASS_OVERLOADED : e == EAGAIN ? CLASS_RESOURCE_LIMIT : CLASS_INTERNAL,
           xasprintf("could not start the call: %s", strerror(e)), NULL);
}

static void on_start_ready(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct call *c = w->data;
    stop_waiting(c);
    c->waited_ms = now_ms() - c->started_ms;
    /* its zygote was taken away meanwhile (it died) and none was given instead: never a
     * start outside the session's world */
    int e = EPIPE;
    if (c->session->zygote && call_spawn(c, c->depth) == 0) {
        call_arm(c);
        return;
    }
    if (c->session->zygote)
        e = errno;
    if (e == EINPROGRESS) {
        call_wait_start(c);         /* the session's zygote now, the same or a new one */
        return;
    }
    starting_abandon(c);
    call_start_failed(c, e);
}

struct call *call_start(struct ev_loop *loop, struct policy *policy, struct session *session,
                        struct call_request *req, call_done_fn on_done,
                        call_output_fn on_output, void *ud)
{
    struct call *c = call_new(loop, policy, session, req, on_done, on_output, ud);
    struct call_decision d;
    if (!call_decide(policy, session->id, session->root, &c->req, &d))
        return refuse(c, d.class, d.message, d.layer);
    c->tool = d.tool;
    c->idempotent = d.idempotent;
    c->timeout_ms = call_timeout(c);
    c->depth = d.depth;
    if (call_spawn(c, d.depth) < 0) {
        int e = errno;
        if (e == EINPROGRESS)       /* only from a session's zygote */
            call_wait_start(c);
        else
            call_start_failed(c, e);
        return c;
    }
    call_arm(c);
    return c;
}

void call_pause_output(struct call *c, bool pause)
{
    if (c->state == CALL_STARTING) {
        c->paused = pause;              /* call_arm starts what is not paused */
        return;
    }
    if (c->paused == pause || c->state == CALL_ANSWERED || c->state == CALL_ACCEPTED)
        return;
    c->paused = pause;
    struct call_stream_state *streams[] = {&c->out, &c->err};
    for (size_t i = 0; i < ARRAY_LEN(streams); i++) {
        if (streams[i]->eof)
            continue;
        if (pause)
            ev_io_stop(c->loop, &streams[i]->watcher);
        else
            ev_io_start(c->loop, &streams[i]->watcher);
    }
    /* The drain guard after exit must not cut output we are merely not reading yet. */
    if (c->state == CALL_REAPED)
        arm_drain_guard(c);
}

void call_free(struct call *c)
{
    if (!c)
        return;
    if (c->state != CALL_ANSWERED && c->state != CALL_ACCEPTED)
        LOG_E("call %s freed while %d", c->req.tool, (int)c->state);
    stop_io(c);
    /* never handed back (a call freed before its end): the runner cannot be trusted idle */
    if (c->runner.sp.pid > 0)
        zygote_runner_done(c->session->runners, &c->runner, false);
    call_request_free(&c->req);
    free(c->result.message);
    buf_free(&c->result.out);
    buf_free(&c->result.err);
    redact_stream_free(&c->out.redact);
    redact_stream_free(&c->err.redact);
    buf_free(&c->out.tail);
    buf_free(&c->err.tail);
    policy_unref(c->policy);
    free(c);
}

int call_exit_status(const struct call_result *r)
{
    switch (r->class) {
    case CLASS_OK:
    case CLASS_TOOL_ERROR:
    case CLASS_RESOURCE_LIMIT:
        if (r->has_exit_code)
            return r->exit_code;
        return r->signal ? 128 + r->signal : 125;
    case CLASS_TOOL_TIMEOUT:
    case CLASS_DEADLINE_EXCEEDED:
    case CLASS_SESSION_EXPIRED:
        return 124;
    case CLASS_POLICY_VIOLATION:
        return 126;
    case CLASS_CANCELLED:
        return r->signal ? 128 + r->signal : 125;
    default:
        return 125;
    }
}
