#include "service.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

int service_listen_fd(void)
{
    int n = sd_listen_fds(1);   /* unsets LISTEN_*: the tools must not see them */
    if (n < 0)
        die("LISTEN_FDS: %s", strerror(-n));
    if (n == 0)
        return -1;
    if (n > 1)
        die("LISTEN_FDS: %d sockets passed, stockade listens on one", n);
    int fd = SD_LISTEN_FDS_START;
    if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0)
        die("LISTEN_FDS: fd %d is not a listening Unix stream socket", fd);
    if (fd_set_cloexec(fd) < 0 || fd_set_nonblock(fd) < 0)
        die_errno("LISTEN_FDS: fd %d", fd);
    return fd;
}

char *service_socket_name(int fd)
{
    struct sockaddr_un sa;
    socklen_t len = sizeof sa;
    memset(&sa, 0, sizeof sa);
    if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0 || len <= sizeof sa.sun_family)
        return xstrdup("socket-activation");
    if (sa.sun_path[0] == 0)
        return xasprintf("socket-activation:unix:@%.*s", (int)(len - sizeof sa.sun_family - 1),
                         sa.sun_path + 1);
    return xasprintf("socket-activation:unix:%.*s", (int)sizeof sa.sun_path, sa.sun_path);
}

void service_ready(void)
{
    sd_notifyf(0, "READY=1\nMAINPID=%d\nSTATUS=serving", (int)getpid());
}

void service_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=draining");
}

static const char *log_path;

/* Async-signal-safe: open, dup2, close. A failed open keeps the old file. */
static void on_sigusr1(int sig)
{
    (void)sig;
    int saved = errno;
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (fd >= 0) {
        if (fd != log_fd) {
            dup3(fd, log_fd, O_CLOEXEC);
            close(fd);
        }
    }
    errno = saved;
}

void service_log_reopen_on_sigusr1(const char *path)
{
    log_path = path;
    struct sigaction sa = {.sa_handler = on_sigusr1, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
}
