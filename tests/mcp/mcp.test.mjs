// `stockade mcp` driven by the official MCP TypeScript SDK client over stdio, as an agent
// host would drive it. Policy: tests/fixtures/mcp.lua.
//
//   STOCKADE_BIN=$PWD/stockade node --test tests/mcp
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { LATEST_PROTOCOL_VERSION, ToolListChangedNotificationSchema } from '@modelcontextprotocol/sdk/types.js';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, '..', '..');
const STOCKADE = process.env.STOCKADE_BIN || path.join(REPO, 'stockade');
const POLICY = path.join(REPO, 'tests', 'fixtures', 'mcp.lua');
// Upper bound on anything that should be quick; generous for a loaded machine.
const BOUND_MS = 20000;

async function waitFor(what, fn, ms = BOUND_MS) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

// One `stockade mcp` with its own state dir; its stderr (the JSON-lines log) is kept.
async function connect(policy = POLICY) {
  const state = fs.mkdtempSync(path.join(os.tmpdir(), 'stockade-mcp-'));
  const transport = new StdioClientTransport({
    command: STOCKADE,
    args: ['mcp', '--policy', policy, '--state-dir', state],
    env: { ...process.env },
    stderr: 'pipe',
  });
  let log = '';
  transport.stderr.on('data', (d) => { log += d.toString(); });
  // every message the server sends, as the client received it
  const received = [];
  let onmessage;
  Object.defineProperty(transport, 'onmessage', {
    get: () => onmessage,
    set: (fn) => { onmessage = fn && ((m, extra) => { received.push(m); fn(m, extra); }); },
  });
  const client = new Client({ name: 'stockade-tests', version: '1.0.0' });
  await client.connect(transport);
  const calls = () => log.split('\n').filter((l) => l.includes('"event":"call"')).map((l) => JSON.parse(l));
  return {
    client, transport, state, calls, received, log: () => log,
    async close() {
      const pid = transport.pid;
      await client.close();
      // EOF is the shutdown: the server exits, and the session's root is gone with it
      await waitFor('stockade mcp to exit', () => !alive(pid));
      const left = fs.existsSync(path.join(state, 'sessions')) ? fs.readdirSync(path.join(state, 'sessions')) : [];
      fs.rmSync(state, { recursive: true, force: true });
      return left;
    },
  };
}

function alive(pid) {
  try { process.kill(pid, 0); return true; } catch { return false; }
}

const text = (r) => r.content.filter((c) => c.type === 'text').map((c) => c.text).join('\n');

describe('stockade mcp', () => {
  let s;
  before(async () => { s = await connect(); });
  after(async () => {
    const left = await s.close();
    assert.deepEqual(left, [], 'the session root is removed at EOF');
  });

  test('initialize: server info, tools capability, negotiated version', async () => {
    assert.equal(s.client.getServerVersion().name, 'stockade');
    assert.equal(s.client.getServerCapabilities().tools.listChanged, true);
    assert.match(s.client.getInstructions(), /mcp-tests/);
    // the SDK sent its latest version; the server speaks it
    const init = s.received.find((m) => m.id !== undefined && m.result?.serverInfo);
    assert.equal(init.result.protocolVersion, LATEST_PROTOCOL_VERSION);
    await s.client.ping();
  });

  test('tools/list: one tool per policy tool, schemas and descriptions from the policy', async () => {
    const { tools } = await s.client.listTools();
    assert.deepEqual(tools.map((t) => t.name), ['echo', 'greet', 'sh', 'slow']);
    const greet = tools.find((t) => t.name === 'greet');
    assert.equal(greet.description, 'Says hello to someone.');
    assert.deepEqual(greet.inputSchema.required, ['name']);
    assert.equal(greet.inputSchema.properties.name.type, 'string');
    const echo = tools.find((t) => t.name === 'echo');
    assert.equal(echo.description, 'Prints its arguments.');
    assert.deepEqual(echo.inputSchema.properties.argv, {
      type: 'array', items: { type: 'string' }, description: "arguments after the tool's program",
    });
    assert.equal(echo.annotations.idempotentHint, true);
    for (const t of tools) assert.ok(t.outputSchema.required.includes('class'));
  });

  test('a successful call: output as text, OK as structured content', async () => {
    const r = await s.client.callTool({ name: 'echo', arguments: { argv: ['hello', 'world'] } });
    assert.equal(r.isError, false);
    assert.equal(text(r), 'hello world\n');
    assert.equal(r.structuredContent.class, 'OK');
    assert.equal(r.structuredContent.exit_code, 0);
    const g = await s.client.callTool({ name: 'greet', arguments: { name: 'mcp' } });
    assert.equal(g.isError, false, text(g));
    assert.equal(text(g), 'hello mcp\n');
  });

  test('a refused call: isError, the policy reason, terminal', async () => {
    const r = await s.client.callTool({ name: 'echo', arguments: { argv: ['forbidden'] } });
    assert.equal(r.isError, true);
    assert.equal(r.structuredContent.class, 'POLICY_VIOLATION');
    assert.equal(r.structuredContent.retryable, false);
    assert.match(text(r), /'forbidden' is refused by this policy/);
    assert.match(text(r), /do not retry/);
    assert.equal(text(r).split('\n').length, 1, 'one line');
    // structured args that fail the tool's schema are refused the same way
    const g = await s.client.callTool({ name: 'greet', arguments: { name: 42 } });
    assert.equal(g.structuredContent.class, 'POLICY_VIOLATION');
  });

  test('a failed call shows the one-line message, never raw stderr', async () => {
    const r = await s.client.callTool({
      name: 'sh', arguments: { argv: ['-c', 'echo stderr-detail-xyz >&2; exit 3'] },
    });
    assert.equal(r.isError, true);
    assert.equal(r.structuredContent.class, 'TOOL_ERROR');
    assert.equal(r.structuredContent.exit_code, 3);
    assert.match(text(r), /exited with status 3/);
    assert.doesNotMatch(JSON.stringify(r), /stderr-detail-xyz/);
  });

  test('a timed-out call: TOOL_TIMEOUT, layer timeout, the tree stopped', async () => {
    const t0 = Date.now();
    const r = await s.client.callTool({ name: 'slow', arguments: { argv: ['30'] } });
    assert.ok(Date.now() - t0 < BOUND_MS, 'answered long before the sleep would end');
    assert.equal(r.isError, true);
    assert.equal(r.structuredContent.class, 'TOOL_TIMEOUT');
    assert.equal(r.structuredContent.layer, 'timeout');
    assert.equal(r.structuredContent.retryable, true, 'slow is declared idempotent');
    assert.match(text(r), /timed out/);
  });

  test('cancellation: notifications/cancelled ends the call, CANCELLED', async () => {
    const ac = new AbortController();
    const before = s.calls().length;
    const t0 = Date.now();
    const p = s.client.callTool(
      { name: 'sh', arguments: { argv: ['-c', 'echo started; exec sleep 60'] } },
      undefined,
      { signal: ac.signal, onprogress: () => ac.abort('enough') },
    );
    await assert.rejects(p);
    const rec = await waitFor('the call record', () => s.calls().slice(before).find((c) => c.tool === 'sh'));
    assert.equal(rec.class, 'CANCELLED');
    assert.ok(Date.now() - t0 < BOUND_MS);
    // the connection serves on
    const r = await s.client.callTool({ name: 'echo', arguments: { argv: ['still', 'here'] } });
    assert.equal(text(r), 'still here\n');
  });

  test('a secret is redacted in the result and in the progress stream', async () => {
    const progress = [];
    // The pause keeps the streamed chunk and the result apart: the SDK drops a progress
    // notification that it reads in the same chunk as its request's result (the result is
    // handled at once, the notification a microtask later).
    const r = await s.client.callTool(
      { name: 'sh', arguments: { argv: ['-c', 'echo key=ITKEY-abcdefghijkl; sleep 1; echo done'] } },
      undefined,
      { onprogress: (p) => progress.push(p) },
    );
    assert.equal(r.isError, false);
    assert.match(text(r), /key=\[REDACTED:it-key\]/);
    assert.doesNotMatch(JSON.stringify(r), /ITKEY-abc/);
    assert.ok(r.structuredContent.redactions >= 1);
    assert.ok(progress.length >= 1, 'streamed output arrived as progress');
    const streamed = progress.map((p) => p.message).join('');
    assert.doesNotMatch(streamed, /ITKEY-abc/);
    assert.match(streamed, /\[REDACTED:it-key\]/);
    // progress only grows
    for (let i = 1; i < progress.length; i++) assert.ok(progress[i].progress > progress[i - 1].progress);
  });

  test('an unknown tool is a protocol error', async () => {
    await assert.rejects(s.client.callTool({ name: 'nope', arguments: {} }), /unknown tool/);
  });
});

test('a policy reload that changes the registry sends tools/list_changed', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'stockade-mcp-policy-'));
  const policy = path.join(dir, 'policy.lua');
  const original = fs.readFileSync(POLICY, 'utf8');
  fs.writeFileSync(policy, original);
  const s = await connect(policy);
  try {
    let changed = 0;
    s.client.setNotificationHandler(ToolListChangedNotificationSchema, () => { changed++; });
    const before = (await s.client.listTools()).tools.map((t) => t.name);
    assert.ok(!before.includes('extra'));
    // the same registry reloaded: no notification; then one with a new tool
    process.kill(s.transport.pid, 'SIGHUP');
    await waitFor('the first reload', () => s.log().includes('generation 2'));
    fs.writeFileSync(policy, original.replace('  tools = {',
      '  tools = {\n    extra = stockade.tool { path = "/bin/true", owner = "tests", timeout = "5s", schema = { type = "object" } },'));
    process.kill(s.transport.pid, 'SIGHUP');
    await waitFor('tools/list_changed', () => changed > 0);
    assert.equal(changed, 1, 'only the reload that changed the registry notified');
    const after = (await s.client.listTools()).tools.map((t) => t.name);
    assert.ok(after.includes('extra'));
    const r = await s.client.callTool({ name: 'extra', arguments: {} });
    assert.equal(r.structuredContent.class, 'OK');
  } finally {
    await s.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
