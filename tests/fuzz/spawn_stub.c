/* The fuzz build's boundary: no process is ever started. */
#include "spawn.h"

#include <errno.h>

int spawn_start(const struct spawn_req *req, struct spawn_child *out)
{
    (void)req, (void)out;
    errno = ENOSYS;
    return -1;
}
