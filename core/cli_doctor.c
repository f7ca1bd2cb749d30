/* `stockade doctor`: what the host can give, layer by layer, with the reason and the fix
 * when it cannot (the peers' most common complaint is a bare "Permission denied"). */
#include "cli.h"
#include "sandbox.h"
#include "session.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int cli_doctor(int argc, char **argv)
{
    (void)argc, (void)argv;
    const struct sandbox_caps *c = sandbox_caps();
    printf("stockade doctor: running as uid %u%s\n", (unsigned)geteuid(),
           c->root ? " (root: per-session service uids, no user namespace needed)" : "");
    for (int l = 0; l < LAYER_COUNT; l++) {
        const char *name = sandbox_layer_name((enum sandbox_layer)l);
        if (l == LAYER_USERNS && c->root) {
            printf("  %-9s not needed (root)%s%s\n", name,
                   c->available[l] ? "" : "; unavailable: ", c->available[l] ? "" : c->reason[l]);
            continue;
        }
        if (c->available[l]) {
            if (l == LAYER_LANDLOCK)
                printf("  %-9s available (ABI %d)\n", name, c->landlock_abi);
            else if (l == LAYER_UID) {
                struct uid_range r = UID_RANGE_DEFAULT;
                printf("  %-9s available (per-session uids %u-%u, --uid-range to change)\n", name,
                       (unsigned)r.first, (unsigned)(r.first + r.count - 1));
            } else
                printf("  %-9s available\n", name);
        } else {
            printf("  %-9s unavailable: %s\n", name, c->reason[l]);
        }
    }
    char *why = NULL;
    bool strict = sandbox_level_allowed("strict", &why);
    printf("isolation strict:  %s%s\n", strict ? "available" : "unavailable: ", strict ? "" : why);
    free(why);
    const char *layers[LAYER_COUNT + 2];
    size_t n = sandbox_active_layers("process", layers);
    printf("isolation process: available (");
    for (size_t i = 0; i < n; i++)
        printf("%s%s", i ? ", " : "", layers[i]);
    printf(")\n");
    return strict ? 0 : 1;
}
