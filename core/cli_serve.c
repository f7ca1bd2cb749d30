/* `stockade serve`: option parsing; the server itself is core/server.c. */
#include "cli.h"
#include "root.h"
#include "rpc.h"
#include "server.h"
#include "service.h"

#include <fcntl.h>
#include <getopt.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char serve_usage[] =
    "usage: stockade serve [--policy FILE] [--state-dir DIR] [--listen unix:PATH]\n"
    "                      [--allow-uid UID]... [--admin-uid UID]... [--socket-mode MODE]\n"
    "                      [--socket-group GROUP] [--max-message SIZE] [--drain-timeout DUR]\n"
    "                      [--uid-range FIRST-LAST] [--log FILE] [--log-level LEVEL]\n"
    "                      [--metrics FILE] [--metrics-interval DUR] [--debug-hooks]\n"
    "Speaks MessagePack-RPC (PROTOCOL.md) on stdin/stdout, on a Unix socket, or on the\n"
    "socket systemd passes (LISTEN_FDS; see stockade.socket).\n"
    "  --policy FILE          default $STOCKADE_POLICY, else /etc/stockade/policy.lua\n"
    "  --state-dir DIR        default $STOCKADE_STATE_DIR, else /var/lib/stockade as root,\n"
    "                         else $XDG_RUNTIME_DIR/stockade\n"
    "  --listen unix:PATH     listen there instead of stdin/stdout\n"
    "  --allow-uid UID        a peer uid allowed to connect (repeatable; default our own)\n"
    "  --admin-uid UID        a peer uid allowed policy.reload (repeatable; default our own)\n"
    "  --socket-mode MODE     the --listen socket's mode (default 0600)\n"
    "  --socket-group GROUP   the --listen socket's group (default: ours)\n"
    "  --max-message SIZE     largest message accepted (default 16MiB)\n"
    "  --drain-timeout DUR    on SIGTERM/SIGINT, how long calls may finish (default 10s)\n"
    "  --uid-range A-B        per-session uids when run as root (default 210000-219999)\n"
    "  --log FILE             JSON-lines log (default stderr); SIGUSR1 reopens it\n"
    "  --log-level LEVEL      error, warn, info (default) or debug\n"
    "  --metrics FILE         Prometheus text file, rewritten every interval, removed at exit\n"
    "  --metrics-interval DUR default 10s\n"
    "  --debug-hooks          debug.* methods for tests\n"
    "  --slow-reader DUR      drop a client that takes none of its output that long\n"
    "                         (default 60s; 0: never)\n"
    "Signals: SIGHUP reloads the policy, SIGTERM/SIGINT drain and stop, SIGUSR1 reopens --log.\n"
    "Logs: one record per call; audit records (startup, session, reload, shutdown) with\n"
    "\"event\"; alarms. Exit status: 0, or 125 usage or start-up error.\n";

/* Options `serve` shares with `mcp`: each dies with a usage line when malformed. */
void cli_opt_log_file(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (fd < 0)
        die_errno("--log %s", path);
    log_fd = fd;
    service_log_reopen_on_sigusr1(path);
}

void cli_opt_log_level(const char *name)
{
    static const char *const levels[] = {"error", "warn", "info", "debug"};
    size_t i = 0;
    while (i < ARRAY_LEN(levels) && strcmp(levels[i], name) != 0)
        i++;
    if (i == ARRAY_LEN(levels))
        die("--log-level: expected error, warn, info or debug, got '%s'", name);
    log_threshold = (enum log_level)i;
}

size_t cli_opt_max_message(const char *size)
{
    int64_t v;
    if (parse_size(size, &v) < 0 || v < 1024 || v > (1LL << 30))
        die("--max-message: expected a size from 1KiB to 1GiB, got '%s'", size);
    return (size_t)v;
}

void cli_opt_uid_range(const char *range, struct uid_range *out)
{
    if (uid_range_parse(range, out) < 0)
        die("--uid-range: expected FIRST-LAST with 0 < FIRST <= LAST, got '%s'", range);
}

void cli_server_opts_init(struct server_opts *o)
{
    *o = (struct server_opts){
        .policy_path = getenv("STOCKADE_POLICY"),
        .max_message = RPC_MAX_MESSAGE_DEFAULT,
        .drain_ms = 10000,
        .uids = UID_RANGE_DEFAULT,
    };
    log_threshold = LOG_INFO;
    log_json = true;
    optind = 1;
}

char *cli_server_opts_finish(struct server_opts *o, const char *state_flag)
{
    if (!o->policy_path)
        o->policy_path = "/etc/stockade/policy.lua";
    char *state_dir = root_state_dir(state_flag);
    if (!state_dir)
        die("no state dir: pass --state-dir, or set STOCKADE_STATE_DIR or XDG_RUNTIME_DIR");
    o->state_dir = state_dir;
    return state_dir;
}

static void add_uid(const char *flag, const char *arg, uid_t *uids, size_t *n)
{
    char *end;
    unsigned long u = strtoul(arg, &end, 10);
    if (*end || !*arg || u > 0xfffffffeUL)
        die("%s: not a uid: '%s'", flag, arg);
    if (*n == 16)
        die("%s: at most 16", flag);
    uids[(*n)++] = (uid_t)u;
}

int cli_serve(int argc, char **argv)
{
    static const struct option opts[] = {
        {"policy", required_argument, 0, 'p'}, {"state-dir", required_argument, 0, 'd'},
        {"listen", required_argument, 0, 'l'}, {"allow-uid", required_argument, 0, 'a'},
        {"max-message", required_argument, 0, 'm'}, {"drain-timeout", required_argument, 0, 't'},
        {"uid-range", required_argument, 0, 'u'}, {"verbose", no_argument, 0, 'v'},
        {"log", required_argument, 0, 'L'}, {"log-level", required_argument, 0, 'E'},
        {"metrics", required_argument, 0, 'M'}, {"metrics-interval", required_argument, 0, 'I'},
        {"debug-hooks", no_argument, 0, 'D'}, {"admin-uid", required_argument, 0, 'A'},
        {"socket-mode", required_argument, 0, 'S'}, {"socket-group", required_argument, 0, 'G'},
        {"slow-reader", required_argument, 0, 'W'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    struct server_opts o;
    cli_server_opts_init(&o);
    o.slow_reader_ms = RPC_SLOW_READER_MS_DEFAULT;
    o.socket_mode = 0600;
    o.socket_gid = (gid_t)-1;
    const char *state_flag = NULL;
    int64_t v;
    int opt;
    while ((opt = getopt_long(argc, argv, "+p:d:l:a:m:t:u:vh", opts, NULL)) != -1) {
        switch (opt) {
        case 'p': o.policy_path = optarg; break;
        case 'd': state_flag = optarg; break;
        case 'l':
            if (strncmp(optarg, "unix:", 5) != 0 || !optarg[5])
                die("--listen: expected unix:PATH, got '%s'", optarg);
            o.listen_path = optarg + 5;
            break;
        case 'a':
            add_uid("--allow-uid", optarg, o.allow_uids, &o.n_allow_uids);
            break;
        case 'A':
            add_uid("--admin-uid", optarg, o.admin_uids, &o.n_admin_uids);
            break;
        case 'S': {
            char *end;
            unsigned long m = strtoul(optarg, &end, 8);
            /* the owner keeps read-write; nothing beyond rw for group and others */
            if (*end || !*optarg || m > 0777 || (m & 0600) != 0600 || (m & 0111))
                die("--socket-mode: expected an octal mode such as 0660 (rw for the owner, "
                    "no x bits), got '%s'", optarg);
            o.socket_mode = (mode_t)m;
            break;
        }
        case 'G': {
            struct group *g = getgrnam(optarg);
            char *end;
            unsigned long gid = strtoul(optarg, &end, 10);
            if (g)
                o.socket_gid = g->gr_gid;
            else if (!*end && *optarg && gid < 0xffffffffUL)
                o.socket_gid = (gid_t)gid;
            else
                die("--socket-group: no such group: '%s'", optarg);
            break;
        }
        case 'm': o.max_message = cli_opt_max_message(optarg); break;
        case 't':
            if (parse_duration_ms(optarg, &v) < 0)
                die("--drain-timeout: bad duration '%s' (expected e.g. 10s)", optarg);
            o.drain_ms = v;
            break;
        case 'W':
            if (parse_duration_ms(optarg, &v) < 0)
                die("--slow-reader: bad duration '%s' (expected e.g. 60s, 0 for never)", optarg);
            o.slow_reader_ms = v;
            break;
        case 'u': cli_opt_uid_range(optarg, &o.uids); break;
        case 'v': log_threshold = LOG_DEBUG; break;
        case 'L': cli_opt_log_file(optarg); break;
        case 'E': cli_opt_log_level(optarg); break;
        case 'M': o.metrics_path = optarg; break;
        case 'I':
            if (parse_duration_ms(optarg, &v) < 0 || v < 100)
                die("--metrics-interval: expected a duration of at least 100ms, got '%s'", optarg);
            o.metrics_interval_ms = v;
            break;
        case 'D': o.debug_hooks = true; break;
        case 'h': fputs(serve_usage, stdout); return 0;
        default: fputs(serve_usage, stderr); return EXIT_USAGE;
        }
    }
    if (optind < argc)
        die("serve: unexpected argument '%s'", argv[optind]);
    o.listen_fd = service_listen_fd();
    if (o.listen_fd >= 0 && o.listen_path)
        die("--listen: systemd passed a socket already (LISTEN_FDS); drop --listen");
    if (o.n_allow_uids == 0)
        o.allow_uids[o.n_allow_uids++] = geteuid();
    if (o.n_admin_uids == 0)
        o.admin_uids[o.n_admin_uids++] = geteuid();
    char *state_dir = cli_server_opts_finish(&o, state_flag);
    int rc = server_run(&o);
    free(state_dir);
    return rc;
}
