/* The fuzz build's boundary: no process is ever started. */
#include "spawn.h"

#include <errno.h>
#include <unistd.h>

int spawn_start(const struct spawn_req *req, struct spawn_child *out)
{
    (void)req, (void)out;
    errno = ENOSYS;
    return -1;
}

void spawn_shim_enter(const struct spawn_req *req, int in_fd, int out_fd, int err_fd,
                      int status_fd, pid_t parent)
{
    (void)req, (void)in_fd, (void)out_fd, (void)err_fd, (void)status_fd, (void)parent;
    _exit(1);
}
