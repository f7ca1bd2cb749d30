/* The floor of the benchmark (tests/bench/run.py compiles it with cc): what starting a
 * process costs with nothing around it, and the timer for every command-line row.
 *
 *   floor fork  N CMD [ARG...]   N x fork + execve + waitpid; one line per iteration:
 *                                its wall time in nanoseconds
 *   floor spawn N CMD [ARG...]   the same with posix_spawn + waitpid
 *   floor par K N CMD [ARG...]   K worker processes, each doing fork + execve + waitpid
 *                                in a loop, N calls in all; one line: the wall time of the
 *                                whole batch in nanoseconds
 *
 * CMD is an absolute path (no PATH lookup, as stockade does), run with an empty
 * environment unless FLOOR_KEEP_ENV=1 (the comparison rows need PATH, HOME, ...). The
 * children's stdin is /dev/null and their stdout /dev/null (FLOOR_STDOUT=inherit keeps
 * it); stderr is inherited so a failing comparator says why. A child that does not exit 0
 * makes the run exit 1 after printing what it measured. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static char *empty_env[] = {NULL};
static char **child_env;
static int devnull_in = -1, devnull_out = -1;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static pid_t fork_exec(char **argv)
{
    pid_t pid = fork();
    if (pid == 0) {
        dup2(devnull_in, 0);
        if (devnull_out >= 0)
            dup2(devnull_out, 1);
        execve(argv[0], argv, child_env);
        _exit(127);
    }
    return pid;
}

static int wait_ok(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return 0;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: floor fork|spawn N CMD [ARG...] | floor par K N CMD [ARG...]\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return usage();
    child_env = getenv("FLOOR_KEEP_ENV") ? environ : empty_env;
    devnull_in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    const char *so = getenv("FLOOR_STDOUT");
    if (!so || strcmp(so, "inherit") != 0)
        devnull_out = open("/dev/null", O_WRONLY | O_CLOEXEC);
    setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    int failed = 0;

    if (strcmp(argv[1], "fork") == 0 || strcmp(argv[1], "spawn") == 0) {
        long n = atol(argv[2]);
        char **cmd = argv + 3;
        int spawn = argv[1][0] == 's';
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, devnull_in, 0);
        if (devnull_out >= 0)
            posix_spawn_file_actions_adddup2(&fa, devnull_out, 1);
        long long *t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
        for (long i = 0; i < n; i++) {
            long long t0 = now_ns();
            pid_t pid;
            if (spawn) {
                int rc = posix_spawn(&pid, cmd[0], &fa, NULL, cmd, child_env);
                if (rc != 0) {
                    fprintf(stderr, "floor: posix_spawn %s: %s\n", cmd[0], strerror(rc));
                    return 1;
                }
            } else {
                pid = fork_exec(cmd);
                if (pid < 0) {
                    perror("floor: fork");
                    return 1;
                }
            }
            if (!wait_ok(pid))
                failed++;
            t[i] = now_ns() - t0;
        }
        for (long i = 0; i < n; i++)
            printf("%lld\n", t[i]);
    } else if (strcmp(argv[1], "par") == 0 && argc >= 5) {
        long k = atol(argv[2]), n = atol(argv[3]);
        char **cmd = argv + 4;
        if (k < 1 || n < k)
            return usage();
        long long t0 = now_ns();
        for (long w = 0; w < k; w++) {
            long share = n / k + (w < n % k ? 1 : 0);
            pid_t wp = fork();
            if (wp == 0) {
                int bad = 0;
                for (long i = 0; i < share; i++) {
                    pid_t pid = fork_exec(cmd);
                    if (pid < 0 || !wait_ok(pid))
                        bad = 1;
                }
                _exit(bad);
            }
            if (wp < 0) {
                perror("floor: fork");
                return 1;
            }
        }
        for (long w = 0; w < k; w++) {
            int st;
            if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
                failed++;
        }
        printf("%lld\n", now_ns() - t0);
    } else {
        return usage();
    }
    fflush(stdout);
    if (failed)
        fprintf(stderr, "floor: %d run(s) did not exit 0\n", failed);
    return failed ? 1 : 0;
}
