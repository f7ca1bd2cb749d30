#ifndef STOCKADE_POLICY_H
#define STOCKADE_POLICY_H
/* The one owner of Lua: a loaded policy is one lua_State with a memory cap, an
 * instruction budget per hook and a locked-down environment. Hooks return plain values
 * that are checked here as if they came from a stranger; any failure falls back to the
 * fail-closed default of POLICY.md. A policy is reference-counted: a call holds the
 * generation it started under. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "redact.h"
#include "sandbox.h"
#include "util.h"

struct policy_timeouts {
    int64_t call_ms, call_max_ms, grace_ms, cpu_ms, fuse_ms, lease_ms, idle_shutdown_ms,
        deadline_min_ms;
};

struct policy_limits {
    int64_t memory;             /* resident memory of a call's whole tree (the shim watches) */
    int64_t address_space;      /* RLIMIT_AS of each process; 0: none */
    int64_t processes, file_size, open_files, output, stdin_bytes, argv, argv_bytes,
        sessions, running, depth, lua_memory, lua_instructions;
    int64_t redact_hold;        /* bytes a possibly-growing secret may hold back */
    int64_t disk, inodes;       /* per session root, watched by each call's shim */
    /* alarm thresholds; -1: derived by the server (fds: growth over the baseline) */
    int64_t alarm_zombies, alarm_fds, alarm_rss, alarm_processes, alarm_sessions;
};

/* A tool's own limits, over the policy's; 0: the policy's. */
struct tool_limits {
    int64_t memory, address_space, processes, file_size, open_files;
};

struct tool_def {
    char *name;
    char *path;
    char *owner;
    char *where;                /* file:line of its stockade.tool{} */
    int64_t timeout_ms;         /* 0: the policy's timeouts.call */
    struct tool_limits limits;
    int ref;                    /* the tool's Lua table, in the registry */
    bool has_accept;
    bool idempotent_declared;   /* the policy decides, not the request's hint */
    bool idempotent;            /* when declared as a boolean */
    bool idempotent_fn;
    bool has_argv;
    bool raw_argv;              /* with an argv hook: raw argv accepted too (accept checks it) */
    bool has_output_check;      /* output = { format = "json", ... } */
    char **env_allow;           /* names this tool may receive, besides the policy's */
    /* redaction, from engine.init: active when the tool's chain has a redactor */
    bool redact_active;
    struct redact_set *redact;
};

struct policy {
    struct lua_State *L;
    unsigned refcount;
    unsigned generation;
    char *path;
    char sha256[65];            /* of the policy file's text, hex */
    char *name;
    char *isolation;            /* "strict" or "process" */
    char *network;              /* "none", "loopback" or "allowlist" */
    struct sandbox_mount *mounts;
    size_t nmounts;
    char *env_path;
    char **env_allow, **env_deny;   /* names; deny entries are globs */
    struct policy_timeouts timeouts;
    struct policy_limits limits;
    struct tool_def *tools;
    size_t ntools;
    char *plugin_dirs[8];
    size_t nplugin_dirs;
    /* budget accounting for the Lua state */
    size_t mem_used, mem_limit;
    int64_t instr_used, instr_limit;
    int64_t hook_deadline_ms;
    bool over_budget, out_of_memory;
    const struct tool_def *hook_tool;   /* whose hook runs now, for the log */
    char *last_error;           /* the last hook failure, for `stockade test` */
    bool loading;               /* the policy file itself is running */
    int load_line;              /* its current line, while loading */
};

enum policy_rc { POLICY_OK, POLICY_ERR, POLICY_TIMEOUT, POLICY_NOMEM };

/* Load and check a policy file completely. NULL and a one-line message in *err (malloc'd)
 * when it cannot be used. */
struct policy *policy_load(const char *path, char **err);
struct policy *policy_ref(struct policy *p);
void policy_unref(struct policy *p);

const struct tool_def *policy_tool(const struct policy *p, const char *name);

/* What a hook sees of a call (copies are made for Lua). */
struct policy_call_view {
    const char *tool;
    char *const *argv;          /* arguments after the binary */
    size_t argc;
    const char *session_id, *session_root;
    int64_t depth;
};

/* accept(call): true, or false with *reason (malloc'd) set. Fails closed. */
bool policy_accept(struct policy *p, const struct tool_def *t,
                   const struct policy_call_view *v, char **reason);
/* The tool's idempotent rule (bool or function), else the request's hint. */
bool policy_idempotent(struct policy *p, const struct tool_def *t,
                       const struct policy_call_view *v, bool hint);

struct policy_classify_input {
    bool has_exit_code;
    int exit_code, signal;
    const char *layer;
    const char *stdout_tail, *stderr_tail;
    size_t stdout_tail_len, stderr_tail_len;
    int64_t duration_ms;
};
/* The tool's classify hook: true with class/retryable/message (malloc'd) when it decided;
 * false keeps the default (also when it failed). */
bool policy_classify(struct policy *p, const struct tool_def *t,
                     const struct policy_classify_input *in, char **class, bool *retryable,
                     char **message);

/* One step of streaming redaction (see lua/engine.lua E.redact): appends the redacted
 * text to out, says how many input bytes it covers. Not OK: withhold the chunk. */
enum policy_rc policy_redact(struct policy *p, const struct tool_def *t, const char *stream,
                             const char *session_id, const char *text, size_t len,
                             enum redact_mode mode, struct buf *out, size_t *consumed,
                             int64_t *count);

/* Streaming redaction for one stream of a call (see redact.h): data (or, with
 * REDACT_EOF, the end) goes in; redacted text comes out through sink, in order. */
void policy_redact_feed(struct policy *p, const struct tool_def *t, const char *stream,
                        const char *session_id, struct redact_stream *rs, const char *data,
                        size_t n, enum redact_mode mode, int64_t *count, redact_sink sink,
                        void *ud);

/* Structured args -> argv: schema-validated, then the tool's argv hook. */
struct msgpack_object;
bool policy_argv(struct policy *p, const struct tool_def *t, const struct msgpack_object *args,
                 const struct policy_call_view *v, char ***argv, size_t *argc, char **reason);

/* output = { format = "json", schema, max_depth }: true when the output passes. */
bool policy_check_output(struct policy *p, const struct tool_def *t, const char *text,
                         size_t len, char **reason);

/* May a request pass "NAME=value" to tool t? False and *why (the refusal) when not.
 * Denied globs win over any allow; the core's own names are never accepted. */
bool policy_env_allowed(const struct policy *p, const struct tool_def *t, const char *entry,
                        char **why);

/* Push onto `to` (another Lua state) a plain copy of the normalized policy: tools,
 * timeouts, limits, env, mounts, network; hook functions as {kind="function", where,
 * source}. For the CI gates and tests. */
void policy_describe(struct policy *p, struct lua_State *to);

/* The last hook failure's message (NULL after a hook that succeeded): what `stockade
 * test` returns as the error of a hook that fell back to its default. */
const char *policy_last_error(const struct policy *p);

/* Called after every hook with the time it took, by the owner of an event loop whose
 * cached clock must not lag behind a long hook (ev_now_update). */
typedef void (*policy_clock_fn)(void *ud);
void policy_set_clock_refresh(policy_clock_fn fn, void *ud);

/* The budgeted entry into Lua, exposed for tests: the function and its nargs arguments
 * are on the stack; leaves nres results on OK, nothing otherwise. */
enum policy_rc policy_pcall(struct policy *p, int nargs, int nres, const char *hook, char **err);

#endif
