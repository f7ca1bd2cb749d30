#ifndef STOCKADE_FUZZ_SERVER_H
#define STOCKADE_FUZZ_SERVER_H
/* What the fuzz targets share: one in-process `serve` (process creation stubbed by
 * spawn_stub.c) on a fresh state directory, both freed at exit, and a way to let what an
 * input started settle. */

struct server;

/* The server, on /tmp/stockade-NAME-XXXXXX, with $FUZZ_POLICY or `default_policy`
 * (relative to the repository, where the fuzzers run). Aborts if it cannot start. */
struct server *fuzz_server_start(const char *name, const char *default_policy);

/* A few non-blocking turns of the server's loop: what the last input queued runs. */
void fuzz_server_settle(struct server *srv);

#endif
