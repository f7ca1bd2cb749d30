#ifndef STOCKADE_CALL_H
#define STOCKADE_CALL_H
/* One tool call as a state machine driven by libev watchers:
 *   accepted -> running -> (terminating) -> reaped -> answered
 * Every resource a call owns (pipes, the shim's pidfd, timers, buffers, its policy
 * generation) is released in one place, call_free(), after it has been answered.
 * `stockade run` and `stockade serve` both drive calls through this one path. */
#include <ev.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proc.h"
#include "redact.h"
#include "spawn.h"
#include "util.h"
#include "zygote.h"

struct policy;
struct tool_def;
struct session;

enum call_class {
    CLASS_OK,
    CLASS_TOOL_ERROR,
    CLASS_TOOL_TIMEOUT,
    CLASS_DEADLINE_EXCEEDED,
    CLASS_SESSION_EXPIRED,
    CLASS_POLICY_VIOLATION,
    CLASS_RESOURCE_LIMIT,
    CLASS_OUTPUT_REJECTED,
    CLASS_CANCELLED,
    CLASS_OVERLOADED,
    CLASS_BAD_REQUEST,
    CLASS_NO_SUCH_SESSION,
    CLASS_INTERNAL,
};
const char *call_class_name(enum call_class c);

struct call_request {
    char *tool;
    char **argv;                /* arguments after the binary */
    size_t argc;
    char *stdin_data;
    size_t stdin_len;
    int64_t timeout_ms;         /* 0: the tool's timeout */
    int64_t deadline_ms;        /* the caller's remaining budget, when has_deadline */
    bool has_deadline;
    int64_t depth;              /* -1: the policy's default */
    bool idempotent_hint;
    bool stream;
    const struct msgpack_object *args;  /* structured args; borrowed, read in call_start */
    char **env;                 /* "NAME=value" the caller asks for; NULL-terminated */
};
void call_request_free(struct call_request *r);

struct call_result {
    enum call_class class;
    bool retryable;
    char *message;
    const char *layer;          /* "timeout", "cpu", "deadline", "fuse", or NULL */
    bool has_exit_code;
    int exit_code;
    int signal;                 /* 0: none */
    struct buf out, err;
    int64_t truncated_out, truncated_err;
    int64_t redactions;
    int64_t duration_ms, cpu_ms, max_rss_kb;
};

/* STARTING: waiting, off the loop, for the session's zygote (a spare, or its world) */
enum call_state { CALL_ACCEPTED, CALL_STARTING, CALL_RUNNING, CALL_TERMINATING, CALL_REAPED,
                  CALL_ANSWERED };
enum call_stream { CALL_STDOUT, CALL_STDERR };

struct call;
typedef void (*call_done_fn)(struct call *c, void *ud);
typedef void (*call_output_fn)(struct call *c, enum call_stream s, const char *data,
                               size_t len, void *ud);

struct call_stream_state {
    int fd;
    ev_io watcher;
    bool eof;
    struct redact_stream redact;    /* read, not yet past redaction */
    struct buf tail;            /* the last bytes delivered, for classify */
};

struct call {
    struct ev_loop *loop;
    enum call_state state;
    struct policy *policy;              /* the generation this call runs under (a ref) */
    const struct tool_def *tool;
    struct session *session;
    struct call_request req;
    struct call_result result;
    bool idempotent;

    struct spawn_child child;
    struct proc proc;
    bool shim_reaped;
    struct zygote *zygote;              /* whose spare runs the call, or is awaited
                                         * (borrowed: kept while a call refers to it) */
    struct zyg_runner runner;           /* the session's runner it runs on (pid -1: none) */
    ev_io start_watcher;                /* STARTING: c->zygote has something for us */
    int64_t depth, waited_ms;           /* for the start when it comes; how long it took */
    ev_io report_watcher;               /* a zygote's shim: its report ends the call */
    bool ran;                           /* the tool ran and ended on its own */
    struct shim_report report;          /* read early: the tree ended before a timer */
    bool have_report;
    struct call_stream_state out, err;
    bool paused;                        /* output not read: the client is behind */
    ev_io stdin_watcher;
    size_t stdin_off;

    ev_timer timeout_timer, deadline_timer, grace_timer, answer_timer;
    ev_timer quiet_timer;               /* flushes what redaction holds back */
    int64_t started_ms, timeout_ms;
    enum call_class kill_class;         /* why we ended it, CLASS_OK if we did not */
    const char *kill_layer;
    const char *kill_why;               /* static; the answer's message when set */

    call_done_fn on_done;
    call_output_fn on_output;
    void *ud;
};

/* Everything decided before a process starts: the tool, structured args turned into argv
 * (req is updated), sizes, depth, the deadline's minimum, env, the accept hook. False:
 * refused, with class, message (malloc'd) and layer set. */
struct call_decision {
    enum call_class class;
    char *message;
    const char *layer;
    const struct tool_def *tool;
    int64_t depth;
    bool idempotent;
};
/* The limits a call of tool t runs under: the tool's own where it sets them, else the
 * policy's. */
struct tool_def;
struct spawn_limits call_spawn_limits(const struct policy *policy, const struct tool_def *t);

bool call_decide(struct policy *policy, const char *session_id, const char *session_root,
                 struct call_request *req, struct call_decision *d);

/* Start a call; ownership of *req moves into the call. The result is always delivered
 * through on_done from the loop (never from inside call_start), refusals included. */
struct call *call_start(struct ev_loop *loop, struct policy *policy, struct session *session,
                        struct call_request *req, call_done_fn on_done,
                        call_output_fn on_output, void *ud);
/* End a running call for a reason (cancel, deadline, session expiry): its tree is
 * terminated and it is answered with `class`; `why` (static) replaces the default
 * message. */
void call_stop(struct call *c, enum call_class class, const char *layer, const char *why,
               bool hard);
/* Stop (or resume) reading the tool's output: back-pressure from a slow client. */
void call_pause_output(struct call *c, bool pause);
/* Release everything; only after on_done. */
void call_free(struct call *c);

/* The exit status convention of `stockade run` (timeout(1) and env(1)). */
int call_exit_status(const struct call_result *r);

#endif
