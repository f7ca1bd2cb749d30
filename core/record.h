#ifndef STOCKADE_RECORD_H
#define STOCKADE_RECORD_H
/* Durable session records: STATE_DIR/records/ID, one small text file per session, beside
 * (never inside) its root, so that a restarted server, an upgraded one, or an operator's
 * `stockade sessions` knows whose each root is, and until when. The records dir is the
 * supervisor's (0700): no tool can write a record or plant a name in it.
 *
 * A record is written before its root is created and removed only after the root is
 * gone, so a crash at any instant leaves either both, or a record alone (never a root
 * alone). Writes are atomic: a temp made with mkostemp in the records dir, fsync,
 * rename, fsync of the dir.
 *
 * The state dir's lock (STATE_DIR/lock, flock) says which process owns the records: a
 * listening server holds it exclusively for its life; `stockade sessions rm|gc` hold it
 * while they remove. Pure file-system code: no loop. */
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* serve: a listening server's session, adopted or removed by the next one; run and
 * stdio: a process's own (`stockade run`; `stockade serve` on stdio, `stockade mcp`),
 * over when that process is. */
#define RECORD_HOLDER_MAX 48

enum record_owner { RECORD_SERVE, RECORD_RUN, RECORD_STDIO };
enum record_state { RECORD_OPEN, RECORD_CLOSING };

struct session_record {
    char id[65];
    enum record_owner owner;
    enum record_state state;    /* closing: its root is being removed */
    bool kept;                  /* `stockade run --session ID`: never expires */
    bool service_uid;           /* uid is a service uid held under /run/stockade/uids */
    uid_t uid;
    uid_t client_uid;           /* serve: the peer that opened it (who may reattach) */
    pid_t pid;                  /* run, stdio: the process that made it (in its own pid
                                 * namespace: informative only when holder is set) */
    /* run, stdio: the name of the lock its process holds for its life beside the records
     * (record_holder_take): alive while that lock is held. "" in an older version's
     * record, which falls back to the pid. */
    char holder[RECORD_HOLDER_MAX];
    char isolation[16];
    char policy_sha256[65];
    int64_t created_ms;         /* wall clock */
    int64_t ttl_ms;
    int64_t lease_at_ms;        /* wall clock: no later than this, unless renewed */
    int64_t fuse_at_ms;         /* wall clock: never later than this */
    char **labels;              /* the client's: key, value, ..., NULL; or NULL */
    /* not stored: written and removed without fsync. A one-shot `stockade run`'s record
     * is read back after a crash of its process (the page cache survives that), never
     * after one of the machine: its root is not synced either, and /run is gone. */
    bool unsynced;
};

/* Write r as STATE_DIR/records/ID. create: fail with EEXIST when a record is there
 * already (a session id is never taken over). 0, or -1 with errno (ENOSPC, EMFILE...). */
int record_write(const char *state_dir, const struct session_record *r, bool create);
/* Read STATE_DIR/records/ID. 0, or -1 with errno (ENOENT; EINVAL: not a record). */
int record_read(const char *state_dir, const char *id, struct session_record *r);
/* 0 when gone (or never there), -1 with errno. */
int record_remove(const char *state_dir, const char *id);
/* The same without the fsync of the records dir (an unsynced record's). */
int record_remove_unsynced(const char *state_dir, const char *id);
/* Free what r holds (not r). */
void record_clear(struct session_record *r);
const char *record_owner_name(enum record_owner o);
/* The ids of the records, and of the roots, in STATE_DIR (malloc'd, NULL-terminated,
 * sorted). NULL with errno when the dir cannot be read (a missing dir is an empty list). */
char **record_ids(const char *state_dir);
char **record_root_ids(const char *state_dir);
/* True when the record's lease or fuse has run out at wall time now, or it was being
 * closed; a run's or a stdio server's when its process is gone (record_process_alive
 * says 0); a kept one never. */
bool record_expired(const char *state_dir, const struct session_record *r, int64_t now);
/* Whether the process that wrote a run's or a stdio server's record still runs: 1, 0 when
 * it is gone, -1 when it cannot tell. With a holder, its lock says (a pid means nothing
 * across pid namespaces, and a reused one keeps a dead run alive); without one (an
 * older version's record), kill(pid, 0). */
int record_process_alive(const char *state_dir, const struct session_record *r);

/* The lock a `stockade run` or a stdio server holds for its life, that its records name:
 * STATE_DIR/records/.holder.UUID, taken exclusively (flock) on an O_CLOEXEC fd, so that
 * the tools it execs do not hold it. The fd (keep it open), name filled in; -1 with
 * errno. */
int record_holder_take(const char *state_dir, char name[RECORD_HOLDER_MAX]);
/* At a clean exit: unlink the holder's file, then close fd. */
void record_holder_drop(const char *state_dir, const char *name, int fd);
/* Unlink the holder files in STATE_DIR/records whose process is gone (a crash leaves
 * them). The number removed. */
unsigned record_holders_sweep(const char *state_dir);
/* The record as one JSON object, for `stockade sessions --json`. */
struct buf;
void record_json(struct buf *b, const struct session_record *r);

/* Take STATE_DIR/lock exclusively without waiting: the fd (keep it open to keep the lock),
 * or -1 and *err (one line; names the holder's pid when another process has it). */
int record_lock_state_dir(const char *state_dir, char **err);
/* The pid of a process holding STATE_DIR's lock, 0 when none, -1 when it cannot tell. */
pid_t record_state_dir_owner(const char *state_dir);

#endif
