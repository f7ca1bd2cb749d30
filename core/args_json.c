/* jansson and core/util.h both declare a json_string(): jansson's is never called here
 * (see core/mcp.c). */
#define json_string jansson_json_string_unused
#include <jansson.h>
#undef json_string

#include "args_json.h"
#include "mcp.h"
#include "util.h"

bool args_from_json(const char *text, msgpack_sbuffer *out, char **err)
{
    json_error_t jerr;
    json_t *j = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!j || !json_is_object(j)) {
        *err = j ? xstrdup("expected a JSON object") : xasprintf("%s", jerr.text);
        json_decref(j);
        return false;
    }
    msgpack_packer pk;
    msgpack_packer_init(&pk, out, msgpack_sbuffer_write);
    mcp_pack_json(&pk, j);
    json_decref(j);
    return true;
}
