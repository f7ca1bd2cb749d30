#ifndef STOCKADE_AUDIT_H
#define STOCKADE_AUDIT_H
/* The audit trail of `serve`: one JSON line per event an operator asks about later
 * (start-up, reloads, shutdown), written through the log (--log FILE or stderr) at level
 * info with "event":"<name>", whatever --log-level says. Each is one call from the
 * server. (Sessions have their records in server.c: "event":"session", with labels.) */
#include <stdbool.h>

struct policy;

/* start-up: version, the policy's path, sha256 and generation, the isolation level's
 * layers, where clients connect ("stdio", "unix:PATH", "socket-activation:PATH") */
void audit_startup(const struct policy *p, const char *policy_path, const char *listen);
/* who: "rpc uid N" or "SIGHUP"; new_p NULL when refused (why says why) */
void audit_reload(const char *who, const char *path, const char *old_sha,
                  const struct policy *new_p, const char *why);
void audit_shutdown(const char *why, unsigned sessions, unsigned running);

#endif
