#ifndef STOCKADE_ROOT_H
#define STOCKADE_ROOT_H
/* Session roots on disk: STATE_DIR/sessions/ID/{workspace,tmp,cache,home}.
 * Pure file-system code: no loop, no processes, so it is unit-tested on its own. */
#include <stdbool.h>
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

/* Remove STATE_DIR/sessions/ID entirely. Never follows a symlink and never descends into
 * another file system (a mount point inside the root is left, and reported).
 * 0 when gone, -1 (errno) when something could not be removed. */
int root_remove(const char *state_dir, const char *id);

/* The walk behind root_remove: remove `name` below `dirfd`, whatever it is. */
int root_remove_tree_at(int dirfd, const char *name);

#endif
