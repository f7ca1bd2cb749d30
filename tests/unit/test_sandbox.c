/* The seccomp walls as a tool gets them: each set of walls attaches exactly one filter,
 * and a walls value outside the known sets is refused, never taken for "attached
 * already" (which would leave the tool with no filter at all). Each case runs in a
 * child of its own: a filter cannot be taken off. */
#include "check.h"
#include "sandbox.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

/* Seccomp_filters of this process, from /proc/self/status; -1 when it is not there. */
static int filters_attached(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    int n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Seccomp_filters: %d", &n) == 1)
            break;
    fclose(f);
    return n;
}

enum { VIA_TOOL, VIA_RUNNER };

/* In a child: attach the walls' filter as a tool (sandbox_apply_seccomp) or as a runner
 * (sandbox_seccomp_attach_self). Exit status: 0 attached one filter; 1 refused with
 * EINVAL and none attached; 2 anything else. */
static int attach_in_child(unsigned walls, int via)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int rc = via == VIA_TOOL ? sandbox_apply_seccomp(walls)
                                 : sandbox_seccomp_attach_self(walls);
        int e = errno, n = filters_attached();
        _exit(rc == 0 && n == 1 ? 0 : rc < 0 && e == EINVAL && n == 0 ? 1 : 2);
    }
    int ws;
    if (waitpid(pid, &ws, 0) != pid || !WIFEXITED(ws))
        return -1;
    return WEXITSTATUS(ws);
}

int main(void)
{
    log_threshold = LOG_ERROR;
    if (!sandbox_caps()->available[LAYER_SECCOMP] || filters_attached() != 0) {
        printf("test_sandbox: skipped: no seccomp filter support here, or this process "
               "runs under a filter already\n");
        return 0;
    }
    CHECK(sandbox_seccomp_prepare() == 0);
    for (unsigned walls = 0; walls < 4; walls++) {
        CHECK(attach_in_child(walls, VIA_TOOL) == 0);
        CHECK(attach_in_child(walls, VIA_RUNNER) == 0);
    }
    const unsigned bad[] = {4, 0x7fffffffu, 0xffffffffu};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(attach_in_child(bad[i], VIA_TOOL) == 1);
        CHECK(attach_in_child(bad[i], VIA_RUNNER) == 1);
    }
    return check_report("test_sandbox");
}
