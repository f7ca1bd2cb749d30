/* The fuzz build's boundary: no process is ever started. Linked with
 * -Wl,--wrap=spawn_start, so the call machinery's spawn_start lands here. */
#include "spawn.h"

#include <errno.h>

int __wrap_spawn_start(const struct spawn_req *req, struct spawn_child *out);

int __wrap_spawn_start(const struct spawn_req *req, struct spawn_child *out)
{
    (void)req, (void)out;
    errno = ENOSYS;
    return -1;
}
