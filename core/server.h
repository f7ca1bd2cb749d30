#ifndef STOCKADE_SERVER_H
#define STOCKADE_SERVER_H
/* `stockade serve`: the protocol of PROTOCOL.md over stdio or a Unix socket. Owns the
 * sessions (with their lease and fuse timers), the connections and the calls in flight;
 * the call machinery itself is core/call.c, the same one `stockade run` drives. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "session.h"

struct server_opts {
    const char *policy_path;
    const char *state_dir;
    const char *listen_path;    /* NULL: stdin/stdout */
    int listen_fd;              /* > 2: a listening socket passed by systemd (LISTEN_FDS) */
    uid_t allow_uids[16];
    size_t n_allow_uids;
    uid_t admin_uids[16];       /* may call policy.reload on the socket */
    size_t n_admin_uids;
    mode_t socket_mode;         /* of the listening socket; 0600 unless --socket-mode */
    gid_t socket_gid;           /* its group, with --socket-group; (gid_t)-1: unchanged */
    size_t max_message;
    int64_t drain_ms;
    int64_t slow_reader_ms;     /* a client that takes none of its output that long is
                                 * dropped; 0: never */
    struct uid_range uids;
    const char *metrics_path;   /* Prometheus text file, or NULL */
    int64_t metrics_interval_ms;
    bool debug_hooks;           /* debug.leak / debug.unleak, for alarm tests */
};

/* Runs until stdin closes (stdio) or SIGTERM/SIGINT drains it. Returns the exit status. */
int server_run(const struct server_opts *opts);

/* The pieces of server_run, for tests and the fuzz harness. */
struct server;
struct policy;
struct srv_conn;
struct server *server_new(const struct server_opts *opts);
struct srv_conn *server_attach(struct server *srv, int rfd, int wfd, uid_t uid);
void server_feed(struct srv_conn *conn, const void *data, size_t len);
struct ev_loop *server_loop(struct server *srv);
/* Accounting baseline, sampler, metrics: once the connections are attached, before ev_run. */
void server_start(struct server *srv);
/* The current policy generation (borrowed: take a ref to keep it past a reload). */
struct policy *server_policy(struct server *srv);
/* fn(ud) after each policy reload that took effect (SIGHUP or policy.reload). */
void server_on_reload(struct server *srv, void (*fn)(void *ud), void *ud);
void server_free(struct server *srv);

#endif
