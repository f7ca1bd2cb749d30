/* libFuzzer target: arbitrary bytes into `stockade mcp`'s line framing, JSON-RPC decoder
 * and dispatcher, in front of a real in-process server with process creation stubbed
 * (spawn_stub.c). Each input is also decoded line by line on its own. Whatever arrives,
 * the front end must answer or ignore it — never crash, leak or hang. */
#include "mcp.h"
#include "root.h"
#include "server.h"
#include "util.h"

#include <ev.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct server *srv;
static struct server_opts opts;
static char state[] = "/tmp/stockade-fuzz-mcp-XXXXXX";
static int devnull = -1;

static void cleanup(void)
{
    server_free(srv);
    close(devnull);
    int tmp = open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    root_remove_tree_at(tmp, state + 5);
    close(tmp);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    if (!mkdtemp(state))
        abort();
    log_threshold = LOG_ERROR;
    signal(SIGPIPE, SIG_IGN);       /* as main() does: a peer gone is an error, not a death */
    opts.policy_path = getenv("FUZZ_POLICY") ? getenv("FUZZ_POLICY") : "tests/fixtures/mcp.lua";
    opts.state_dir = state;
    /* Not a real socket: set so that the front end going away does not stop the server. */
    opts.listen_path = "fuzz";
    opts.max_message = 64 * 1024;
    opts.drain_ms = 1000;
    opts.uids = UID_RANGE_DEFAULT;
    srv = server_new(&opts);
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the decoder alone, on each line */
    const char *p = (const char *)data, *end = p + size;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = (size_t)((nl ? nl : end) - p);
        struct mcp_msg msg;
        mcp_decode(p, len, &msg);
        mcp_msg_free(&msg);
        p += len + 1;
    }
    /* the whole front end: framing, dispatch, the server behind it */
    int in[2];
    if (pipe2(in, O_CLOEXEC) < 0)
        abort();
    struct mcp_opts mo = {.max_message = 16 * 1024};
    struct mcp *m = mcp_new(srv, in[0], devnull, &mo);
    mcp_feed(m, data, size);
    struct ev_loop *loop = server_loop(srv);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
    /* the client goes away: EOF ends the front end and its server connection */
    close(in[1]);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
    mcp_free(m);
    close(in[0]);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
    return 0;
}
