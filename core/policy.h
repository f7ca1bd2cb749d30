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

struct policy_timeouts {
    int64_t call_ms, call_max_ms, grace_ms, cpu_ms, fuse_ms, lease_ms, idle_shutdown_ms,
        deadline_min_ms;
};

struct policy_limits {
    int64_t memory, processes, file_size, open_files, output, stdin_bytes, argv, argv_bytes,
        sessions, running, depth, lua_memory, lua_instructions;
};

struct tool_def {
    char *name;
    char *path;
    char *owner;
    char *where;                /* file:line of its stockade.tool{} */
    int64_t timeout_ms;         /* 0: the policy's timeouts.call */
    int ref;                    /* the tool's Lua table, in the registry */
    bool has_accept;
    bool idempotent_declared;   /* the policy decides, not the request's hint */
    bool idempotent;            /* when declared as a boolean */
    bool idempotent_fn;
};

struct policy {
    struct lua_State *L;
    unsigned refcount;
    unsigned generation;
    char *path;
    char sha256[65];            /* of the policy file's text, hex */
    char *name;
    char *isolation;
    char *env_path;
    struct policy_timeouts timeouts;
    struct policy_limits limits;
    struct tool_def *tools;
    size_t ntools;
    /* budget accounting for the Lua state */
    size_t mem_used, mem_limit;
    int64_t instr_used, instr_limit;
    int64_t hook_deadline_ms;
    bool over_budget, out_of_memory;
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

/* The budgeted entry into Lua, exposed for tests: the function and its nargs arguments
 * are on the stack; leaves nres results on OK, nothing otherwise. */
enum policy_rc policy_pcall(struct policy *p, int nargs, int nres, const char *hook, char **err);

#endif
