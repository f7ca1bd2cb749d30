#include "audit.h"
#include "policy.h"
#include "sandbox.h"
#include "util.h"
#include "version.h"

#include <stdlib.h>

static void emit(struct buf *f)
{
    log_json_line("info", f->data);
    buf_free(f);
}

void audit_startup(const struct policy *p, const char *policy_path, const char *listen)
{
    struct buf f = {0};
    buf_printf(&f, "\"event\":\"startup\",\"version\":\"%s\",\"policy\":", STOCKADE_VERSION);
    json_cstr(&f, policy_path);
    buf_printf(&f, ",\"sha256\":\"%s\",\"generation\":%u,\"isolation\":", p->sha256,
               p->generation);
    json_cstr(&f, p->isolation);
    const char *layers[LAYER_COUNT + 2];
    size_t n = sandbox_active_layers(p->isolation, layers);
    buf_printf(&f, ",\"layers\":[");
    for (size_t i = 0; i < n; i++) {
        buf_printf(&f, i ? "," : "");
        json_cstr(&f, layers[i]);
    }
    buf_printf(&f, "],\"listen\":");
    json_cstr(&f, listen);
    emit(&f);
}

void audit_reload(const char *who, const char *path, const char *old_sha,
                  const struct policy *new_p, const char *why)
{
    struct buf f = {0};
    buf_printf(&f, "\"event\":\"reload\",\"by\":");
    json_cstr(&f, who);
    buf_printf(&f, ",\"policy\":");
    json_cstr(&f, path);
    buf_printf(&f, ",\"accepted\":%s,\"old_sha256\":\"%s\"", new_p ? "true" : "false", old_sha);
    if (new_p)
        buf_printf(&f, ",\"new_sha256\":\"%s\",\"generation\":%u", new_p->sha256,
                   new_p->generation);
    else {
        buf_printf(&f, ",\"reason\":");
        json_cstr(&f, why);
    }
    emit(&f);
}

void audit_shutdown(const char *why, unsigned sessions, unsigned running)
{
    struct buf f = {0};
    buf_printf(&f, "\"event\":\"shutdown\",\"reason\":");
    json_cstr(&f, why);
    buf_printf(&f, ",\"sessions\":%u,\"running\":%u", sessions, running);
    emit(&f);
}
