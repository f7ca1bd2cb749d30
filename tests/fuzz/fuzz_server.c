/* The fuzz targets' server (fuzz_server.h). */
#include "fuzz_server.h"
#include "root.h"
#include "server.h"
#include "util.h"

#include <ev.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static struct server *srv;
static struct server_opts opts;
static char state[64];

static void cleanup(void)
{
    server_free(srv);       /* closes the sessions inputs opened, removing their roots */
    int tmp = open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    root_remove_tree_at(tmp, state + 5);
    close(tmp);
}

struct server *fuzz_server_start(const char *name, const char *default_policy)
{
    snprintf(state, sizeof state, "/tmp/stockade-%s-XXXXXX", name);
    if (!mkdtemp(state))
        abort();
    log_threshold = LOG_ERROR;
    signal(SIGPIPE, SIG_IGN);       /* as main() does: a peer gone is an error, not a death */
    opts.policy_path = getenv("FUZZ_POLICY") ? getenv("FUZZ_POLICY") : default_policy;
    opts.state_dir = state;
    /* Not a real socket: set so that a peer going away is not "the orchestrator left". */
    opts.listen_path = "fuzz";
    opts.max_message = 64 * 1024;
    opts.drain_ms = 1000;
    opts.uids = UID_RANGE_DEFAULT;
    srv = server_new(&opts);
    atexit(cleanup);
    return srv;
}

void fuzz_server_settle(struct server *s)
{
    struct ev_loop *loop = server_loop(s);
    for (int i = 0; i < 4; i++)
        ev_run(loop, EVRUN_NOWAIT);
}
