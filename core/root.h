#ifndef STOCKADE_ROOT_H
#define STOCKADE_ROOT_H
/* Session roots on disk: STATE_DIR/sessions/ID/{workspace,tmp,cache,home}.
 * Pure file-system code: no loop, no processes, so it is unit-tested on its own. */
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* The state dir: the flag, else $STOCKADE_STATE_DIR, else /var/lib/stockade as root or
 * $XDG_RUNTIME_DIR/stockade otherwise. Returns a malloc'd path or NULL (no candidate). */
char *root_state_dir(const char *flag);

/* ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ (PROTOCOL.md): safe as one path component. */
bool root_id_valid(const char *id);

/* Create STATE_DIR/sessions/ID and its four dirs, mode 0700, owned by uid:gid (when the
 * caller may chown). The state dir and sessions/ are created 0711 if missing: the tool
 * uid must traverse them, never list them. An existing root is reused when `reuse`,
 * else EEXIST. Returns the malloc'd root path, or NULL with errno set. */
char *root_create(const char *state_dir, const char *id, uid_t uid, gid_t gid, bool reuse);

/* The one way privileged code opens a path a tool can write: `rel` resolved beneath the
 * directory `dirfd` with no symlink (magic or not) and no ".." out of it, anywhere along
 * the way. openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS); where
 * the kernel lacks openat2, a walk one component at a time with O_NOFOLLOW that refuses
 * "..". No allocation (safe in a vfork-style child). flags as for openat (O_CLOEXEC is
 * added); O_CREAT only for the last component. fd, or -1 with errno (ELOOP: a symlink on
 * the way; EXDEV: out of dirfd). */
int root_open_beneath(int dirfd, const char *rel, int flags, mode_t mode);
/* That fallback on its own (for its test). */
int root_open_walk(int dirfd, const char *rel, int flags, mode_t mode);

/* mkdir -p of `rel` beneath `dirfd`, pinned like root_open_beneath at every step (never
 * through a planted symlink). Returns the last directory opened O_DIRECTORY, or -1. */
int root_mkdirs_beneath(int dirfd, const char *rel, mode_t mode);

/* What a session root holds, for limits.disk and limits.inodes: bytes allocated and
 * inodes, on the root's own mount (mount points inside are skipped), never
 * following a symlink. The walk stops as soon as either cap is passed (0: no cap), so a
 * tool's tree costs at most the caps. 0, or -1 with errno (E2BIG: deeper than
 * ROOT_USAGE_MAX_DEPTH, which counts as over the caps). */
#define ROOT_USAGE_MAX_DEPTH 128
struct root_usage {
    int64_t bytes, inodes;
};
int root_usage_at(int dirfd, int64_t max_bytes, int64_t max_inodes, struct root_usage *out);

/* Remove STATE_DIR/sessions/ID entirely. Never follows a symlink and never descends into
 * another file system (a mount point inside the root is left, and reported).
 * 0 when gone, -1 (errno) when something could not be removed. */
int root_remove(const char *state_dir, const char *id);

/* The walk behind root_remove: remove `name` below `dirfd`, whatever it is. */
int root_remove_tree_at(int dirfd, const char *name);

/* What a removal cost, in the units that decide its time: passes over directories (a
 * pass costs the directory's whole size on disk, removed entries included: ext4 keeps
 * them as holes), the most passes over any one directory, and entries read. */
struct root_remove_stats {
    uint64_t passes, max_dir_passes, entries_read;
    uint64_t max_batch_held;    /* most bytes of names the walk held at once */
};
int root_remove_tree_counted(int dirfd, const char *name, struct root_remove_stats *stats);

#endif
