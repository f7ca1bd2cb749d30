/* `stockade run`: one call in a fresh session, printed, with the exit status convention
 * of timeout(1). A thin client of the call machinery that `serve` uses. */
#include "cli.h"
#include "args_json.h"
#include "call.h"
#include "policy.h"
#include "proc.h"
#include "root.h"
#include "sandbox.h"
#include "record.h"
#include "session.h"
#include "zygote.h"

#include <errno.h>
#include <getopt.h>
#include <msgpack.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char run_usage[] =
    "usage: stockade run [--policy FILE] [--session ID] [--state-dir DIR] [--timeout DUR]\n"
    "                    [--stdin] [--json] [--uid-range FIRST-LAST] -- TOOL [ARG...]\n"
    "       stockade run [options] --args JSON -- TOOL     (structured args, for tools\n"
    "                    whose argv hook builds the command line)\n"
    "One call of TOOL (a name in the policy's registry) in a fresh session, printed.\n"
    "  --policy FILE     default $STOCKADE_POLICY, else /etc/stockade/policy.lua\n"
    "  --session ID      keep the session's root under that name (reused if it exists)\n"
    "  --state-dir DIR   default $STOCKADE_STATE_DIR, else /var/lib/stockade as root,\n"
    "                    else $XDG_RUNTIME_DIR/stockade\n"
    "  --timeout DUR     below the tool's timeout (e.g. 300ms, 5s); default the tool's\n"
    "  --stdin           pass our stdin to the tool (default: none)\n"
    "  --json            print the result map (PROTOCOL.md) with session_id\n"
    "  --args JSON       structured args (a JSON object) in place of ARG...\n"
    "  --uid-range A-B   per-session uids when run as root (default 210000-219999)\n"
    "  --verbose         debug logging on stderr\n"
    "Environment: STOCKADE_DEPTH (the calling tool's depth budget), STOCKADE_PLUGIN_PATH.\n"
    "Exit status: the tool's; 124 a timeout class; 126 POLICY_VIOLATION; 128+N the tool\n"
    "died of signal N; 130 interrupted by SIGINT (143 SIGTERM); 125 usage error or\n"
    "stockade's own failure.\n";

struct run_ctx {
    struct ev_loop *loop;
    struct call *call;
    ev_signal sigint, sigterm;
    int interrupted_by;         /* the signal that stopped the call, 0 if none */
};

/* After a long policy hook: timers armed next must count from the true time. */
static void refresh_loop_clock(void *loop)
{
    ev_now_update(loop);
}

static void on_run_done(struct call *c, void *ud)
{
    struct run_ctx *ctx = ud;
    (void)c;
    ev_signal_stop(ctx->loop, &ctx->sigint);
    ev_signal_stop(ctx->loop, &ctx->sigterm);
    ev_break(ctx->loop, EVBREAK_ALL);
}

static void on_run_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop, (void)revents;
    struct run_ctx *ctx = w->data;
    if (!ctx->interrupted_by)
        ctx->interrupted_by = w->signum;
    call_stop(ctx->call, CLASS_CANCELLED, NULL, "interrupted by a signal to stockade", false);
}

static char *read_all_stdin(size_t *len, int64_t limit)
{
    struct buf b = {0};
    char chunk[65536];
    for (;;) {
        ssize_t n = read(0, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        buf_append(&b, chunk, (size_t)n);
        if ((int64_t)b.len > limit)
            break;      /* the call is refused for its size; no need to read on */
    }
    *len = b.len;
    return b.data;
}

/* The result as one JSON object (`stockade run --json`). */
static void json_call_result(struct buf *b, const struct call_result *r, const char *session_id)
{
    buf_append_lit(b, "{\"class\":");
    json_cstr(b, call_class_name(r->class));
    buf_printf(b, ",\"retryable\":%s,\"message\":", r->retryable ? "true" : "false");
    json_cstr(b, r->message);
    buf_append_lit(b, ",\"layer\":");
    json_cstr(b, r->layer);
    if (r->has_exit_code)
        buf_printf(b, ",\"exit_code\":%d", r->exit_code);
    else
        buf_printf(b, ",\"exit_code\":null");
    if (r->signal)
        buf_printf(b, ",\"signal\":%d", r->signal);
    else
        buf_printf(b, ",\"signal\":null");
    buf_append_lit(b, ",\"stdout\":");
    json_string(b, r->out.data ? r->out.data : "", r->out.len);
    buf_append_lit(b, ",\"stderr\":");
    json_string(b, r->err.data ? r->err.data : "", r->err.len);
    buf_printf(b,
               ",\"truncated\":{\"stdout\":%lld,\"stderr\":%lld},\"redactions\":%lld,"
               "\"duration_ms\":%lld,\"cpu_ms\":%lld,\"max_rss_kb\":%lld",
               (long long)r->truncated_out, (long long)r->truncated_err,
               (long long)r->redactions, (long long)r->duration_ms, (long long)r->cpu_ms,
               (long long)r->max_rss_kb);
    if (session_id) {
        buf_append_lit(b, ",\"session_id\":");
        json_cstr(b, session_id);
    }
    buf_append_lit(b, "}");
}

int cli_run(int argc, char **argv)
{
    static const struct option opts[] = {
        {"policy", required_argument, 0, 'p'}, {"session", required_argument, 0, 's'},
        {"state-dir", required_argument, 0, 'd'}, {"timeout", required_argument, 0, 't'},
        {"json", no_argument, 0, 'j'}, {"stdin", no_argument, 0, 'i'},
        {"uid-range", required_argument, 0, 'u'}, {"verbose", no_argument, 0, 'v'},
        {"args", required_argument, 0, 'a'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *args_json = NULL;
    const char *policy_path = getenv("STOCKADE_POLICY");
    const char *session_id = NULL, *state_flag = NULL;
    int64_t timeout_ms = 0;
    bool json = false, with_stdin = false;
    struct uid_range uids = UID_RANGE_DEFAULT;
    int opt;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "+p:s:d:t:jiu:vh", opts, NULL)) != -1) {
        switch (opt) {
        case 'p': policy_path = optarg; break;
        case 's': session_id = optarg; break;
        case 'd': state_flag = optarg; break;
        case 't':
            if (parse_duration_ms(optarg, &timeout_ms) < 0 || timeout_ms <= 0)
                die("--timeout: bad duration '%s' (expected e.g. 300ms, 5s, 2m)", optarg);
            break;
        case 'j': json = true; break;
        case 'i': with_stdin = true; break;
        case 'u':
            if (uid_range_parse(optarg, &uids) < 0)
                die("--uid-range: expected FIRST-LAST with 0 < FIRST <= LAST, got '%s'", optarg);
            break;
        case 'v': log_threshold = LOG_DEBUG; break;
        case 'a': args_json = optarg; break;
        case 'h': fputs(run_usage, stdout); return 0;
        default: fputs(run_usage, stderr); return EXIT_USAGE;
        }
    }
    if (optind >= argc)
        die("run: no tool given (stockade run [options] -- TOOL [ARG...]; --help for more)");
    if (!policy_path)
        policy_path = "/etc/stockade/policy.lua";
    if (session_id && !root_id_valid(session_id))
        die("--session: bad id '%s' (expected [A-Za-z0-9][A-Za-z0-9_.-]{0,63})", session_id);

    struct call_request req = {.timeout_ms = timeout_ms, .depth = -1};
    const char *depth_env = getenv("STOCKADE_DEPTH");
    if (depth_env && *depth_env) {
        char *end;
        errno = 0;
        long long d = strtoll(depth_env, &end, 10);
        if (errno || *end || d < -1000000 || d > 1000000)
            die("STOCKADE_DEPTH: not an integer: '%s'", depth_env);
        req.depth = d;
    }

    char *err = NULL;
    /* The call's shim is made by a spawner forked now, while this process is small: a
     * shim forked once the policy is loaded copies all of it, and both processes then
     * take a page fault for each page either writes (microseconds each on a VM). The
     * spawner's spare prepares itself (private /proc, seccomp) on the other CPU while
     * the policy loads. Strict isolation has the session's zygote make its shim: the
     * spawner, started before the policy says which, is then stopped unused. */
    struct zygote *spawner = zygote_start_begin(&(struct zygote_config){.plain = true}, &err);
    if (spawner) {
        zygote_one_shot(spawner);
    } else {
        LOG_D("no spawner, the call's shim is forked from here: %s", err);
        free(err);
        err = NULL;
    }
    struct policy *policy = policy_load(policy_path, &err);
    if (!policy)
        die("%s", err);
    char *state_dir = root_state_dir(state_flag);
    if (!state_dir)
        die("no state dir: pass --state-dir, or set STOCKADE_STATE_DIR or XDG_RUNTIME_DIR");

    req.tool = xstrdup(argv[optind]);
    req.argc = (size_t)(argc - optind - 1);
    req.argv = xcalloc(req.argc + 1, sizeof *req.argv);
    for (size_t i = 0; i < req.argc; i++)
        req.argv[i] = xstrdup(argv[optind + 1 + (int)i]);
    if (with_stdin)
        req.stdin_data = read_all_stdin(&req.stdin_len, policy->limits.stdin_bytes);
    msgpack_sbuffer args_buf;
    msgpack_sbuffer_init(&args_buf);
    msgpack_unpacked args;
    msgpack_unpacked_init(&args);
    if (args_json) {
        if (req.argc > 0)
            die("run: --args and ARG... are exclusive (the argv hook builds the command line)");
        char *why = NULL;
        size_t off = 0;
        if (!args_from_json(args_json, &args_buf, &why))
            die("--args: %s", why);
        if (msgpack_unpack_next(&args, args_buf.data, args_buf.size, &off) !=
            MSGPACK_UNPACK_SUCCESS)
            die("--args: cannot be read back");
        req.args = &args.data;
    }

    /* A loop of our own, not the default one: libev's default loop reaps every child
     * itself, and reaping belongs to core/proc.c alone. */
    struct ev_loop *loop = ev_loop_new(EVFLAG_AUTO);
    if (!loop)
        die("cannot create the event loop");
    proc_init(loop);
    policy_set_clock_refresh(refresh_loop_clock, loop);
    /* watched before anything is made on disk: a ^C from here on cancels the call (its
     * callback runs in ev_run, once ctx.call is set), where the default action would end
     * this process with the session's root and record left behind */
    struct run_ctx ctx = {.loop = loop};
    ev_signal_init(&ctx.sigint, on_run_signal, SIGINT);
    ev_signal_init(&ctx.sigterm, on_run_signal, SIGTERM);
    ctx.sigint.data = ctx.sigterm.data = &ctx;
    ev_signal_start(loop, &ctx.sigint);
    ev_signal_start(loop, &ctx.sigterm);

    bool strict = strcmp(policy->isolation, "strict") == 0;
    if (spawner && (strict || zygote_start_finish(spawner, &err) < 0)) {
        if (!strict)
            LOG_D("no spawner, the call's shim is forked from here: %s", err);
        free(err);
        err = NULL;
        if (strict)
            zygote_stop(spawner);       /* (a failed start has freed it) */
        spawner = NULL;
    }
    char *why = NULL;
    if (!sandbox_level_allowed(policy->isolation, &why))
        die("policy %s requires isolation=%s, which this host cannot give: %s", policy_path,
            policy->isolation, why);
    if (!sandbox_network_allowed(policy->isolation, policy->network, &why))
        die("policy %s: %s", policy_path, why);
    /* recorded, so that `stockade sessions` and a server on the same state dir know the
     * root is this run's (kept: the next run's) */
    struct session_record rec = {
        .owner = RECORD_RUN, .kept = session_id != NULL, .pid = getpid(),
        .created_ms = wall_ms(),
        /* a one-shot run's root lives as long as this process: its record need only
         * survive our crash, not the machine's (record.h); a kept root's is durable */
        .unsynced = session_id == NULL,
    };
    /* alive while this process is, whatever pid namespace a reader is in */
    int holder_fd = record_holder_take(state_dir, rec.holder);
    if (holder_fd < 0)
        die("state dir %s: the run's lock: %s", state_dir, strerror(errno));
    snprintf(rec.isolation, sizeof rec.isolation, "%s", policy->isolation);
    snprintf(rec.policy_sha256, sizeof rec.policy_sha256, "%s", policy->sha256);
    struct session *session = session_open_recorded(state_dir, session_id, session_id != NULL,
                                                    uids, &rec, &err);
    if (!session)
        die("%s", err);
    session->keep_root = session_id != NULL;
    /* Without a spawner's spare, the shim is forked from here (or, strict, from the
     * session's zygote forked next) and its tool attaches filters compiled here: only
     * those this run's one tool gets (as call.c sets its walls), each costs a compile. */
    unsigned walls = (strcmp(policy->network, "loopback") != 0 ? SANDBOX_NET_CLOSED : 0) |
                     (strict ? 0 : SANDBOX_HOST_SHARED);
    if (!spawner && sandbox_seccomp_prepare_walls(walls) < 0)
        die_errno("compiling the seccomp filter");
    if (!session_isolate(session, policy, spawner, &err)) {
        session_close(session);
        die("%s", err);
    }
    /* its spare: there by now, or soon (a fork of a small process) */
    zygote_standby(spawner, 2000, NULL);
    if (spawner && spawner->npool == 0 && sandbox_seccomp_prepare_walls(walls) < 0)
        die_errno("compiling the seccomp filter");

    ctx.call = call_start(loop, policy, session, &req, on_run_done, NULL, &ctx);
    msgpack_unpacked_destroy(&args);        /* read by call_start only */
    msgpack_sbuffer_destroy(&args_buf);
    ev_run(loop, 0);

    const struct call_result *r = &ctx.call->result;
    if (json) {
        struct buf b = {0};
        json_call_result(&b, r, session->id);
        buf_append(&b, "\n", 1);
        write_all(1, b.data, b.len);
        buf_free(&b);
    } else {
        write_all(1, r->out.data ? r->out.data : "", r->out.len);
        write_all(2, r->err.data ? r->err.data : "", r->err.len);
        if (r->class != CLASS_OK && r->class != CLASS_TOOL_ERROR)
            fprintf(stderr, "stockade: %s: %s\n", call_class_name(r->class), r->message);
        if (r->truncated_out || r->truncated_err)
            fprintf(stderr, "stockade: output truncated (%lld stdout, %lld stderr bytes dropped)\n",
                    (long long)r->truncated_out, (long long)r->truncated_err);
    }
    int status = call_exit_status(r);
    /* as a shell reports a command it interrupted: 128 + the signal (130 for ^C) */
    if (ctx.interrupted_by && r->class == CLASS_CANCELLED)
        status = 128 + ctx.interrupted_by;
    call_free(ctx.call);
    /* the call is over: the spawner goes first (its idle runner with it, PDEATHSIG), so
     * that both die while the root is removed */
    zygote_stop(spawner);
    if (session_close(session) < 0 && status == 0)
        status = 125;
    record_holder_drop(state_dir, rec.holder, holder_fd);
    policy_unref(policy);
    proc_shutdown();
    ev_loop_destroy(loop);
    free(state_dir);
    return status;
}
