#ifndef STOCKADE_SERVICE_H
#define STOCKADE_SERVICE_H
/* Running under systemd (contrib/systemd/): socket activation, readiness and stopping
 * through sd_notify, and --log reopened on SIGUSR1 for logrotate. Each is a no-op when
 * systemd did not start us. */

/* The one listening Unix stream socket systemd passed (LISTEN_FDS), made CLOEXEC, or -1
 * when none was passed. More than one, or one of another kind, is a start-up error. */
int service_listen_fd(void);
/* "socket-activation:unix:PATH" for the start-up record; malloc'd. */
char *service_socket_name(int fd);
void service_ready(void);
void service_stopping(void);
/* SIGUSR1 reopens PATH onto log_fd (same descriptor number, so nothing else changes). */
void service_log_reopen_on_sigusr1(const char *path);

#endif
