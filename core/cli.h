#ifndef STOCKADE_CLI_H
#define STOCKADE_CLI_H
/* The subcommands; each returns the process exit status. */
int cli_run(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_mcp(int argc, char **argv);
int cli_test(int argc, char **argv);
int cli_doctor(int argc, char **argv);
int cli_soak(int argc, char **argv);
int cli_gate(const char *command, int argc, char **argv);

#endif
