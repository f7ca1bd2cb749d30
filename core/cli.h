#ifndef STOCKADE_CLI_H
#define STOCKADE_CLI_H
#include <stddef.h>

/* The subcommands; each returns the process exit status. */

/* A usage error, in every subcommand (a bad option, a missing or extra argument); also
 * what die() exits with. 125, as env(1) and timeout(1): `run` passes the tool's own
 * status through, so stockade's must stay out of a tool's usual range. */
#define EXIT_USAGE 125

int cli_run(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_mcp(int argc, char **argv);
int cli_test(int argc, char **argv);
int cli_doctor(int argc, char **argv);
int cli_soak(int argc, char **argv);
int cli_sessions(int argc, char **argv);
int cli_gate(const char *command, int argc, char **argv);

/* Options `serve` and `mcp` share (core/cli_serve.c): each dies on a malformed value. */
struct uid_range;
void cli_opt_log_file(const char *path);
void cli_opt_log_level(const char *name);
size_t cli_opt_max_message(const char *size);
void cli_opt_uid_range(const char *range, struct uid_range *out);

/* What `serve` and `mcp` start from, before their options: the server's defaults (the
 * policy from $STOCKADE_POLICY), logging as JSON lines at info, getopt reset. */
struct server_opts;
void cli_server_opts_init(struct server_opts *o);
/* ... and after them: /etc/stockade/policy.lua where no policy was named, and the state
 * directory (--state-dir or the environment's; the caller frees it once the server has
 * run); dies when there is none. */
char *cli_server_opts_finish(struct server_opts *o, const char *state_flag);

#endif
