/* The fuzz build's boundary: no process is ever started. Linked with
 * -Wl,--wrap=spawn_start,--wrap=zygote_start,--wrap=zygote_start_begin, so the call
 * machinery's spawn_start and the server's spawner (and any session's zygote) land here. */
#include "sandbox.h"
#include "zygote.h"
#include "spawn.h"
#include "util.h"

#include <errno.h>

int __wrap_spawn_start(const struct spawn_req *req, struct spawn_child *out);

int __wrap_spawn_start(const struct spawn_req *req, struct spawn_child *out)
{
    (void)req, (void)out;
    errno = ENOSYS;
    return -1;
}

struct zygote *__wrap_zygote_start(const struct zygote_config *cfg, char **err);

struct zygote *__wrap_zygote_start(const struct zygote_config *cfg, char **err)
{
    (void)cfg;
    *err = xasprintf("no processes in the fuzz build");
    return NULL;
}

struct zygote *__wrap_zygote_start_begin(const struct zygote_config *cfg, char **err);

struct zygote *__wrap_zygote_start_begin(const struct zygote_config *cfg, char **err)
{
    (void)cfg;
    *err = xasprintf("no processes in the fuzz build");
    return NULL;
}
