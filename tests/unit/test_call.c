/* The call machinery driven directly, as `run` and `serve` drive it: results, the kill of
 * a whole tree, stdin larger than a pipe, refusals from the loop, and nothing leaked
 * (descriptors, children) after many calls. */
#include "call.h"
#include "check.h"
#include "policy.h"
#include "proc.h"
#include "session.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[] = "/tmp/stockade-test-call-XXXXXX";
static struct ev_loop *loop;
static struct policy *policy;
static struct session *session;

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (de->d_name[0] != '.')
            n++;
    if (d)
        closedir(d);
    return n;
}

struct outcome {
    bool done;
    struct call *call;
};

static void on_done(struct call *c, void *ud)
{
    struct outcome *o = ud;
    o->done = true;
    o->call = c;
}

/* Run one call to its answer; returns it (the caller frees). */
static struct call *run_call(const char *tool, const char *const *args, const char *in,
                             size_t in_len, int64_t timeout_ms)
{
    struct call_request req = {.tool = xstrdup(tool), .depth = -1, .timeout_ms = timeout_ms};
    size_t n = 0;
    while (args && args[n])
        n++;
    req.argv = xcalloc(n + 1, sizeof *req.argv);
    for (size_t i = 0; i < n; i++)
        req.argv[i] = xstrdup(args[i]);
    req.argc = n;
    if (in) {
        req.stdin_data = xmalloc(in_len);
        memcpy(req.stdin_data, in, in_len);
        req.stdin_len = in_len;
    }
    struct outcome o = {0};
    struct call *c = call_start(loop, policy, session, &req, on_done, NULL, &o);
    CHECK(!o.done);     /* never answered from inside call_start */
    while (!o.done)
        ev_run(loop, EVRUN_ONCE);
    CHECK(o.call == c);
    return c;
}

static void test_ok_and_error(void)
{
    const char *echo[] = {"-c", "echo hi; echo err >&2", NULL};
    struct call *c = run_call("sh", echo, NULL, 0, 0);
    CHECK(c->result.class == CLASS_OK && c->result.has_exit_code && c->result.exit_code == 0);
    CHECK_STR(c->result.out.data, "hi\n");
    CHECK_STR(c->result.err.data, "err\n");
    call_free(c);
    const char *fail[] = {"-c", "exit 3", NULL};
    c = run_call("sh", fail, NULL, 0, 0);
    CHECK(c->result.class == CLASS_TOOL_ERROR && c->result.exit_code == 3);
    CHECK(call_exit_status(&c->result) == 3);
    call_free(c);
}

static void test_refusals(void)
{
    struct call *c = run_call("rm", NULL, NULL, 0, 0);
    CHECK(c->result.class == CLASS_POLICY_VIOLATION && !c->result.retryable);
    CHECK(!c->result.has_exit_code && c->result.signal == 0);
    CHECK(call_exit_status(&c->result) == 126);
    call_free(c);
    c = run_call("missing", NULL, NULL, 0, 0);
    CHECK(c->result.class == CLASS_INTERNAL && strstr(c->result.message, "could not start"));
    call_free(c);
}

static bool pid_alive(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char buf[256] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    char *rp = n ? strrchr(buf, ')') : NULL;
    return rp && rp[2] != 'Z';
}

static void test_timeout_kills_the_tree(void)
{
    /* ignores SIGTERM, and leaves a daemonized grandchild */
    const char *args[] = {"-c", "setsid sleep 100 & echo $!; trap '' TERM; sleep 100", NULL};
    struct call *c = run_call("sh", args, NULL, 0, 200);
    CHECK(c->result.class == CLASS_TOOL_TIMEOUT);
    CHECK_STR(c->result.layer, "timeout");
    CHECK(c->result.signal == SIGKILL);
    CHECK(c->result.retryable == false);    /* sh is not idempotent */
    pid_t bg = (pid_t)atoi(c->result.out.data ? c->result.out.data : "0");
    CHECK(bg > 0 && !pid_alive(bg));
    call_free(c);
}

static void test_stop_cancels(void)
{
    const char *args[] = {"100", NULL};
    struct call_request req = {.tool = xstrdup("sleep"), .depth = -1};
    req.argv = xcalloc(2, sizeof *req.argv);
    req.argv[0] = xstrdup(args[0]);
    req.argc = 1;
    struct outcome o = {0};
    struct call *c = call_start(loop, policy, session, &req, on_done, NULL, &o);
    ev_run(loop, EVRUN_NOWAIT);
    call_stop(c, CLASS_CANCELLED, NULL, NULL, false);
    while (!o.done)
        ev_run(loop, EVRUN_ONCE);
    CHECK(c->result.class == CLASS_CANCELLED && c->result.signal == SIGTERM);
    call_free(c);
}

static void test_big_stdin(void)
{
    size_t n = 300 * 1024;      /* several pipe buffers */
    char *in = xmalloc(n);
    for (size_t i = 0; i < n; i++)
        in[i] = (char)('a' + i % 26);
    struct call *c = run_call("cat", NULL, in, n, 0);
    CHECK(c->result.class == CLASS_OK && c->result.out.len == n);
    CHECK(c->result.out.len == n && memcmp(c->result.out.data, in, n) == 0);
    call_free(c);
    free(in);
}

static void test_nothing_leaks(void)
{
    int fds_before = count_fds();
    const char *args[] = {"-c", "echo x; (setsid sleep 100 &) ; sleep 100 &", NULL};
    for (int i = 0; i < 40; i++) {
        struct call *c = run_call("sh", args, NULL, 0, 0);
        CHECK(c->result.class == CLASS_OK);
        call_free(c);
    }
    CHECK(count_fds() == fds_before);
    CHECK(proc_live() == 0);
    siginfo_t si;
    memset(&si, 0, sizeof si);
    errno = 0;
    /* no child of ours is left, not even a zombie */
    CHECK(waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD);
}

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    chmod(dir, 0711);
    log_threshold = LOG_ERROR;
    char *path = xasprintf("%s/policy.lua", dir);
    FILE *f = fopen(path, "w");
    fputs("local stockade = require 'stockade'\n"
          "return stockade.policy {\n"
          "  timeouts = { call = '20s', grace = '200ms' },\n"
          "  limits = { output = '1MiB' },\n"
          "  tools = {\n"
          "    sh = stockade.tool { path = '/bin/sh' },\n"
          "    cat = stockade.tool { path = '/bin/cat', idempotent = true },\n"
          "    sleep = stockade.tool { path = '/bin/sleep' },\n"
          "    missing = stockade.tool { path = '/nonexistent/tool' },\n"
          "  },\n"
          "}\n", f);
    fclose(f);
    char *err = NULL;
    policy = policy_load(path, &err);
    if (!policy) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    loop = ev_loop_new(EVFLAG_AUTO);
    proc_init(loop);
    char *state = xasprintf("%s/state", dir);
    session = session_open(state, NULL, false, UID_RANGE_DEFAULT, &err);
    CHECK(session != NULL);
    if (!session) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    test_ok_and_error();
    test_refusals();
    test_timeout_kills_the_tree();
    test_stop_cancels();
    test_big_stdin();
    test_nothing_leaks();
    CHECK(session_close(session) == 0);
    policy_unref(policy);
    proc_shutdown();
    ev_loop_destroy(loop);
    char *cmd = xasprintf("rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    free(cmd);
    free(state);
    free(path);
    return check_report("test_call");
}
