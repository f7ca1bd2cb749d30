/* libFuzzer target: arbitrary bytes into the decoder and the dispatcher of `serve`, over
 * one connection per input, with process creation stubbed (spawn_stub.c). Whatever
 * arrives, the server must answer or drop the peer — never crash, leak or hang. */
#include "root.h"
#include "server.h"
#include "util.h"

#include <ev.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static struct server *srv;
static struct server_opts opts;
static char state[] = "/tmp/stockade-fuzz-XXXXXX";

static void cleanup(void)
{
    server_free(srv);       /* closes the sessions inputs opened, removing their roots */
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
    opts.policy_path = getenv("FUZZ_POLICY") ? getenv("FUZZ_POLICY") : "policies/default.lua";
    opts.state_dir = state;
    /* Not a real socket: set so that a peer going away is not "the orchestrator left". */
    opts.listen_path = "fuzz";
    opts.max_message = 64 * 1024;
    opts.drain_ms = 1000;
    opts.uids = UID_RANGE_DEFAULT;
    srv = server_new(&opts);
    atexit(cleanup);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0)
        abort();
    int out = open("/dev/null", O_WRONLY | O_CLOEXEC);
    struct srv_conn *conn = server_attach(srv, p[0], out, geteuid());
    server_feed(conn, data, size);
    struct ev_loop *loop = server_loop(srv);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
    /* The peer goes away: EOF on its stream closes and frees the connection. */
    close(p[1]);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
    return 0;
}
