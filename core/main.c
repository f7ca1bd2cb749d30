/* stockade: a supervisor for the tool calls of AI agents. */
#include "cli.h"
#include "util.h"
#include "version.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const char usage[] =
    "usage: stockade COMMAND [ARGS]      (stockade COMMAND --help: its options)\n"
    "  run [options] -- TOOL [ARG...]   run one tool call in a fresh session\n"
    "  serve [options]                  the MessagePack-RPC server (stdin/stdout or a socket)\n"
    "  mcp [options]                    the policy's tools as an MCP server on stdin/stdout\n"
    "  test FILE...                     run LuaUnit policy tests (stockade.testing)\n"
    "  check [--json] [POLICY...]       CI gate: problems in a policy, one per line\n"
    "  diff OLD NEW [--json] [--fail-on-widen]   CI gate: what a policy change widens\n"
    "  dry-run [--json] [POLICY]        CI gate: run each tool's probe, prove no write outside\n"
    "  budget [POLICY] [--json]         CI gate: the timeout budget table\n"
    "  sessions list|show ID|rm ID|gc   a state dir's sessions, with or without a server\n"
    "  doctor [--json]                  which isolation layers this host can give, and why not\n"
    "  soak [--duration 1h] [...]       drive a real serve at 2x concurrency, fail on leaks\n"
    "  version                          print the version\n"
    "Environment: STOCKADE_POLICY (default policy, else /etc/stockade/policy.lua),\n"
    "STOCKADE_STATE_DIR (else /var/lib/stockade as root, $XDG_RUNTIME_DIR/stockade),\n"
    "STOCKADE_PLUGIN_PATH (where require \"plugins.X\" looks first).\n"
    "Exit status 125: a usage error, in every subcommand. Manual: stockade(1),\n"
    "stockade-policy(5), stockade-protocol(7).\n";

int main(int argc, char **argv)
{
    /* 0, 1 and 2 must be open: otherwise a pipe could land on them and be clobbered. */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
            return 125;
    /* A tool that closes its stdin must not kill the supervisor writing to it. */
    signal(SIGPIPE, SIG_IGN);

    if (argc < 2) {
        fputs(usage, stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "run") == 0)
        return cli_run(argc - 1, argv + 1);
    if (strcmp(cmd, "serve") == 0)
        return cli_serve(argc - 1, argv + 1);
    if (strcmp(cmd, "mcp") == 0)
        return cli_mcp(argc - 1, argv + 1);
    if (strcmp(cmd, "test") == 0)
        return cli_test(argc - 1, argv + 1);
    if (strcmp(cmd, "doctor") == 0)
        return cli_doctor(argc - 1, argv + 1);
    if (strcmp(cmd, "sessions") == 0)
        return cli_sessions(argc - 1, argv + 1);
    if (strcmp(cmd, "soak") == 0)
        return cli_soak(argc - 1, argv + 1);
    if (!strcmp(cmd, "check") || !strcmp(cmd, "diff") || !strcmp(cmd, "dry-run") ||
        !strcmp(cmd, "budget"))
        return cli_gate(cmd, argc - 1, argv + 1);
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        if (argc > 2 && (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0)) {
            puts("usage: stockade version\nPrints \"stockade VERSION\".");
            return 0;
        }
        if (argc > 2) {
            fprintf(stderr, "stockade version: unexpected argument '%s'\n", argv[2]);
            return EXIT_USAGE;
        }
        puts("stockade " STOCKADE_VERSION);
        return 0;
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
        fputs(usage, stdout);
        return 0;
    }
    fputs(usage, stderr);
    fprintf(stderr, "stockade: unknown command '%s'\n", cmd);
    return EXIT_USAGE;
}
