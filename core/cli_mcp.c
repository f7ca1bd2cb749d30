/* `stockade mcp`: option parsing; the MCP front end is core/mcp.c, the server behind it
 * core/server.c. */
#include "cli.h"
#include "mcp.h"
#include "server.h"
#include "util.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char mcp_usage[] =
    "usage: stockade mcp [--policy FILE] [--state-dir DIR] [--session-ttl DUR]\n"
    "                    [--max-message SIZE] [--uid-range FIRST-LAST] [--log FILE]\n"
    "                    [--log-level LEVEL]\n"
    "A Model Context Protocol server on stdin/stdout (JSON-RPC 2.0, one message per line):\n"
    "every tool of the policy is an MCP tool; the calls of one connection share one session.\n"
    "  --policy FILE        default $STOCKADE_POLICY, else /etc/stockade/policy.lua\n"
    "  --state-dir DIR      default $STOCKADE_STATE_DIR, else /var/lib/stockade as root,\n"
    "                       else $XDG_RUNTIME_DIR/stockade\n"
    "  --session-ttl DUR    the session's lease (default: the policy's timeouts.lease)\n"
    "  --max-message SIZE   largest JSON message accepted (default 4MiB)\n"
    "  --uid-range A-B      per-session uids when run as root (default 210000-219999)\n"
    "  --log FILE           JSON-lines log (default stderr); SIGUSR1 reopens it\n"
    "  --log-level LEVEL    error, warn, info (default) or debug\n"
    "Exit status: 0, or 125 usage or start-up error.\n";

int cli_mcp(int argc, char **argv)
{
    static const struct option opts[] = {
        {"policy", required_argument, 0, 'p'}, {"state-dir", required_argument, 0, 'd'},
        {"session-ttl", required_argument, 0, 't'}, {"max-message", required_argument, 0, 'm'},
        {"uid-range", required_argument, 0, 'u'}, {"log", required_argument, 0, 'L'},
        {"log-level", required_argument, 0, 'E'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    struct server_opts so;
    cli_server_opts_init(&so);
    struct mcp_opts mo = {.max_message = MCP_MAX_MESSAGE_DEFAULT};
    const char *state_flag = NULL;
    int64_t v;
    int opt;
    while ((opt = getopt_long(argc, argv, "+p:d:t:m:u:h", opts, NULL)) != -1) {
        switch (opt) {
        case 'p': so.policy_path = optarg; break;
        case 'd': state_flag = optarg; break;
        case 't':
            if (parse_duration_ms(optarg, &v) < 0 || v <= 0)
                die("--session-ttl: expected a positive duration such as 10m, got '%s'", optarg);
            mo.session_ttl_ms = v;
            break;
        case 'm': mo.max_message = cli_opt_max_message(optarg); break;
        case 'u': cli_opt_uid_range(optarg, &so.uids); break;
        case 'L': cli_opt_log_file(optarg); break;
        case 'E': cli_opt_log_level(optarg); break;
        case 'h': fputs(mcp_usage, stdout); return 0;
        default: fputs(mcp_usage, stderr); return EXIT_USAGE;
        }
    }
    if (optind < argc)
        die("mcp: unexpected argument '%s'", argv[optind]);
    so.allow_uids[so.n_allow_uids++] = geteuid();
    char *state_dir = cli_server_opts_finish(&so, state_flag);
    /* a JSON message becomes one msgpack request: the server must take what we take */
    if (so.max_message < mo.max_message + 4096)
        so.max_message = mo.max_message + 4096;
    int rc = mcp_run(&so, &mo);
    free(state_dir);
    return rc;
}
