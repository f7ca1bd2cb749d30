---@meta stockade
-- LuaLS annotations for policy files, so editors complete and type-check them. Point the
-- language server at this directory (the repository's .luarc.json does). The field
-- lists are checked against the loader's (tests/lua/test_reference.lua).

---@alias stockade.Duration string  # "250ms", "30s", "10m", "2h"
---@alias stockade.Size integer|string  # bytes, or "64KiB", "1MiB", "2GiB"

---@class stockade.Call
---@field tool string
---@field argv string[]
---@field args table?
---@field session { id: string, root: string }
---@field depth integer
---@field env table<string, string>

---@class stockade.Result
---@field exit_code integer?
---@field signal integer?
---@field layer string?
---@field stdout_tail string
---@field stderr_tail string
---@field duration_ms integer

---@alias stockade.RedactFn fun(text: string, ctx: { stream: string, tool: string, session: string }): string, integer?

---@class stockade.Redactor
---@field regex string?
---@field open string?
---@field pattern string?
---@field literal string?
---@field prefix string?
---@field iprefix string?
---@field replace string?
---@field window integer?
---@field name string?

---@alias stockade.Redact stockade.RedactFn|stockade.Redactor|(stockade.RedactFn|stockade.Redactor)[]

---@class stockade.Timeouts
---@field call stockade.Duration?
---@field call_max stockade.Duration?
---@field grace stockade.Duration?
---@field cpu stockade.Duration?
---@field fuse stockade.Duration?
---@field lease stockade.Duration?
---@field idle_shutdown stockade.Duration?
---@field deadline_min stockade.Duration?

---@class stockade.Alarms
---@field zombies integer?
---@field fds integer?
---@field rss stockade.Size?
---@field processes integer?
---@field sessions integer?

---@class stockade.Limits
---@field memory stockade.Size?
---@field address_space stockade.Size?
---@field processes integer?
---@field file_size stockade.Size?
---@field open_files integer?
---@field disk stockade.Size?
---@field inodes integer?
---@field output stockade.Size?
---@field stdin stockade.Size?
---@field argv integer?
---@field argv_bytes stockade.Size?
---@field sessions integer?
---@field running integer?
---@field depth integer?
---@field redact_hold stockade.Size?
---@field lua_memory stockade.Size?
---@field lua_instructions integer?
---@field alarms stockade.Alarms?

---@class stockade.Env
---@field path string?
---@field allow string[]?
---@field deny string[]?

---@class stockade.ToolLimits
---@field memory stockade.Size?
---@field address_space stockade.Size?
---@field processes integer?
---@field file_size stockade.Size?
---@field open_files integer?

---@class stockade.Output
---@field format "text"|"json"?
---@field schema table?
---@field max_depth integer?

---@class stockade.Tool
---@field path string
---@field owner string?
---@field description string?
---@field schema table?
---@field timeout stockade.Duration?
---@field idempotent boolean|fun(call: stockade.Call): boolean
---@field accept (fun(call: stockade.Call): boolean, string?)?
---@field argv (fun(args: table, call: stockade.Call): string[])?
---@field raw_argv boolean?
---@field redact stockade.Redact?
---@field classify (fun(r: stockade.Result): string?, boolean?, string?)?
---@field output stockade.Output?
---@field probe { argv: string[]?, args: table? }?
---@field env string[]?
---@field limits stockade.ToolLimits?

---@class stockade.Policy
---@field name string?
---@field isolation "strict"|"process"?
---@field timeouts stockade.Timeouts?
---@field limits stockade.Limits?
---@field env stockade.Env?
---@field mounts { [1]: string, [2]: string, ro: boolean? }[]?
---@field network "none"|"loopback"?
---@field redact stockade.Redact?
---@field tools table<string, stockade.Tool>?

---@class stockade
local stockade = {}

---@param t stockade.Policy
---@return table
function stockade.policy(t) end

---@param t stockade.Tool
---@return stockade.Tool
function stockade.tool(t) end

---@param s stockade.Duration
---@return integer ms
function stockade.duration(s) end

---@param s string
---@return integer bytes
function stockade.size(s) end

stockade.path = {}
---@param session { id: string, root: string }
---@param p string
---@return string? resolved
---@return string? why
function stockade.path.resolve(session, p) end

---@param call stockade.Call
---@param list string[]
---@return boolean ok
---@return string? why
function stockade.paths_beneath(call, list) end

stockade.json = { null = nil }
---@return string
function stockade.json.encode(v) end
---@return any
function stockade.json.decode(s) end

stockade.schema = {}
---@return boolean ok
---@return string? err
function stockade.schema.validate(schema, value) end
---@return boolean ok
---@return string? err
function stockade.schema.check_schema(schema) end

---@param level "debug"|"info"|"warn"|"error"
---@param msg string
---@param fields table?
function stockade.log(level, msg, fields) end

---@type table<string, string[]>
stockade.fields = {}

return stockade
