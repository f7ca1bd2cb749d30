// Node client of `stockade serve` (PROTOCOL.md, protocol 2). Types: index.d.ts.
//
// One connection per Client: requests go out as [0, msgid, method, [params]], responses
// are matched by msgid, `call.output` notifications go to the streaming call they belong
// to, other notifications are emitted as events. Anything the server sends that is not
// MessagePack-RPC fails every pending request with ProtocolError at once.

import { spawn } from 'node:child_process';
import { EventEmitter } from 'node:events';
import net from 'node:net';
import { DecodeError, Encoder, decodeMultiStream } from '@msgpack/msgpack';

export const PROTOCOL_VERSION = 2;
const MSGID_MAX = 0xffffffff;

// ---- errors ---------------------------------------------------------------------------

/** A failure reported by stockade: the protocol's error map. */
export class StockadeError extends Error {
  constructor(message, { klass, retryable, layer, raw, msgid, result } = {}) {
    super(message);
    this.name = new.target.name;
    this.class = klass ?? new.target.CLASS ?? 'UNKNOWN';
    this.retryable = retryable ?? false;
    this.layer = layer ?? null;
    this.raw = raw ?? null;
    this.msgid = msgid ?? null;
    this.result = result ?? null;
  }
}

function errorClass(name, cls, retryable = false) {
  const C = { [name]: class extends StockadeError {} }[name];
  C.CLASS = cls;
  C.RETRYABLE = retryable;
  return C;
}

export const ToolError = errorClass('ToolError', 'TOOL_ERROR');
export const ToolTimeout = errorClass('ToolTimeout', 'TOOL_TIMEOUT');
export const DeadlineExceeded = errorClass('DeadlineExceeded', 'DEADLINE_EXCEEDED');
export const SessionExpired = errorClass('SessionExpired', 'SESSION_EXPIRED');
export const PolicyViolation = errorClass('PolicyViolation', 'POLICY_VIOLATION');
export const ResourceLimit = errorClass('ResourceLimit', 'RESOURCE_LIMIT');
export const OutputRejected = errorClass('OutputRejected', 'OUTPUT_REJECTED');
export const Cancelled = errorClass('Cancelled', 'CANCELLED');
export const Overloaded = errorClass('Overloaded', 'OVERLOADED', true);
export const BadRequest = errorClass('BadRequest', 'BAD_REQUEST');
export const NoSuchSession = errorClass('NoSuchSession', 'NO_SUCH_SESSION');
export const Internal = errorClass('Internal', 'INTERNAL');
export const UnknownErrorClass = errorClass('UnknownErrorClass', 'UNKNOWN');
/** The connection went away before the answer came. */
export const ConnectionClosed = errorClass('ConnectionClosed', 'CONNECTION_CLOSED');
/** The server sent something that is not MessagePack-RPC as PROTOCOL.md defines it. */
export const ProtocolError = errorClass('ProtocolError', 'PROTOCOL_ERROR');
/** No response within rpcTimeoutMs (the request may still run on the server). */
export const RpcTimeout = errorClass('RpcTimeout', 'RPC_TIMEOUT');

export const ERROR_CLASSES = Object.fromEntries(
  [ToolError, ToolTimeout, DeadlineExceeded, SessionExpired, PolicyViolation, ResourceLimit,
    OutputRejected, Cancelled, Overloaded, BadRequest, NoSuchSession, Internal]
    .map((C) => [C.CLASS, C]));

/** The exception for an error map {class, retryable, message, layer}. */
export function errorFromMap(err, { msgid, result } = {}) {
  if (err === null || typeof err !== 'object' || Array.isArray(err)) {
    return new ProtocolError(`error slot is not a map: ${JSON.stringify(err)}`, { msgid });
  }
  const name = typeof err.class === 'string' ? err.class : 'UNKNOWN';
  const C = ERROR_CLASSES[name] ?? UnknownErrorClass;
  return new C(typeof err.message === 'string' ? err.message : '', {
    klass: name, retryable: Boolean(err.retryable), layer: err.layer ?? null, raw: err,
    msgid, result,
  });
}

// ---- results --------------------------------------------------------------------------

const toBuffer = (v) => (v instanceof Uint8Array ? Buffer.from(v.buffer, v.byteOffset, v.byteLength)
  : typeof v === 'string' ? Buffer.from(v) : Buffer.alloc(0));

/** The result of a `call`, also when the tool failed or was refused. */
export class CallResult {
  constructor(m, msgid = null) {
    this.raw = m;
    this.msgid = msgid;
    this.class = m.class;
    this.retryable = Boolean(m.retryable);
    this.message = m.message ?? '';
    this.layer = m.layer ?? null;
    this.exitCode = m.exit_code ?? null;
    this.signal = m.signal ?? null;
    this.stdout = toBuffer(m.stdout);
    this.stderr = toBuffer(m.stderr);
    this.truncated = { stdout: m.truncated?.stdout ?? 0, stderr: m.truncated?.stderr ?? 0 };
    this.redactions = m.redactions ?? 0;
    this.durationMs = m.duration_ms ?? 0;
    this.cpuMs = m.cpu_ms ?? 0;
    this.maxRssKb = m.max_rss_kb ?? 0;
  }

  /** True when the tool ran and exited 0. */
  get ok() { return this.class === 'OK'; }

  /** Throw the matching StockadeError unless the class is OK; returns this otherwise. */
  raiseForClass() {
    if (this.ok) return this;
    throw errorFromMap(this.raw, { msgid: this.msgid, result: this });
  }
}

// ---- a small async queue for streamed output -------------------------------------------

class ChunkQueue {
  constructor() { this.items = []; this.waiters = []; this.ended = false; }

  push(item) {
    const w = this.waiters.shift();
    if (w) w({ value: item, done: false });
    else this.items.push(item);
  }

  end() {
    this.ended = true;
    for (const w of this.waiters.splice(0)) w({ value: undefined, done: true });
  }

  next() {
    if (this.items.length) return Promise.resolve({ value: this.items.shift(), done: false });
    if (this.ended) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve) => this.waiters.push(resolve));
  }
}

// ---- calls and sessions ---------------------------------------------------------------

/** A call in flight: `await handle.result`, `for await (const chunk of handle)`. */
export class CallHandle {
  constructor(client, msgid, resultPromise, chunks) {
    this.client = client;
    this.msgid = msgid;
    this.result = resultPromise;
    this._chunks = chunks;
  }

  /** Ask the server to cancel it; the call still answers, with class CANCELLED. */
  cancel() { return this.client.cancel(this.msgid); }

  /** Streamed output ({stream, data}) until the call is answered (stream: true only). */
  [Symbol.asyncIterator]() {
    const q = this._chunks;
    return { next: () => (q ? q.next() : Promise.resolve({ value: undefined, done: true })) };
  }
}

/** A session: its calls run in its root; `close()` removes it. */
export class Session {
  constructor(client, info) {
    this.client = client;
    this.id = info.session_id;
    this.root = info.root ?? null;
    this.expiresAtMs = info.expires_at_ms ?? null;
    this.fuseAtMs = info.fuse_at_ms ?? null;
    this.closed = false;
  }

  /** Run `tool` with `argv`; resolves to its CallResult (never rejects for a failed tool). */
  call(tool, argv = [], opts = {}) { return this.client.call(this.id, tool, argv, opts); }

  /** Start `tool`; returns its CallHandle at once. */
  startCall(tool, argv = [], opts = {}) { return this.client.startCall(this.id, tool, argv, opts); }

  /** Start `tool` with output streamed: iterate the handle, then `await handle.result`. */
  stream(tool, argv = [], opts = {}) {
    return this.client.startCall(this.id, tool, argv, { ...opts, stream: true });
  }

  /** Touch the lease; resolves to the new expires_at_ms. */
  async renew() {
    this.expiresAtMs = (await this.client.request('session.renew', { session_id: this.id }))
      .expires_at_ms;
    return this.expiresAtMs;
  }

  /** Kill its calls and remove its root: {removed, calls_killed}; idempotent. */
  async close() {
    const res = await this.client.request('session.close', { session_id: this.id });
    this.closed = true;
    return res;
  }
}

function callParams(sessionId, tool, argv, opts) {
  const p = { session_id: sessionId, tool };
  if (opts.args !== undefined) p.args = opts.args;
  else if (argv) p.argv = [...argv];
  if (opts.stdin !== undefined) {
    p.stdin = typeof opts.stdin === 'string' ? Buffer.from(opts.stdin) : opts.stdin;
  }
  const keys = [['timeoutMs', 'timeout_ms'], ['deadlineMs', 'deadline_ms'], ['depth', 'depth'],
    ['idempotent', 'idempotent'], ['env', 'env']];
  for (const [k, wire] of keys) if (opts[k] !== undefined) p[wire] = opts[k];
  if (opts.stream) p.stream = true;
  return p;
}

// ---- the client -----------------------------------------------------------------------

/**
 * A connection to one `stockade serve`. Events: 'notification' (method, params) for every
 * notification not routed to a streaming call, plus one event per method name
 * ('session.expired', 'alarm'); 'close' (reason).
 */
export class Client extends EventEmitter {
  constructor(readable, writable, { rpcTimeoutMs = null, child = null, socket = null } = {}) {
    super();
    this.rpcTimeoutMs = rpcTimeoutMs;
    this.child = child;
    this.socket = socket;
    this.closed = false;
    this.closeReason = null;
    this._out = writable;
    // a write to a peer that went away: reported once, by the read loop's end
    writable.on?.('error', () => {});
    this._encoder = new Encoder();
    this._pending = new Map();
    this._next = 1;
    this._reading = this._readLoop(readable);
  }

  /** Spawn `argv` (e.g. ['stockade', 'serve', '--policy', P]) and speak on its pipes. */
  static spawn(argv, { rpcTimeoutMs = null, stderr = 'inherit', env } = {}) {
    const child = spawn(argv[0], argv.slice(1), { stdio: ['pipe', 'pipe', stderr], env });
    return new Client(child.stdout, child.stdin, { rpcTimeoutMs, child });
  }

  /** Connect to `stockade serve --listen unix:PATH`. */
  static connectUnix(path, { rpcTimeoutMs = null } = {}) {
    return new Promise((resolve, reject) => {
      const sock = net.createConnection(path);
      sock.once('error', reject);
      sock.once('connect', () => {
        sock.off('error', reject);
        sock.on('error', () => {});   // reported through the read loop
        resolve(new Client(sock, sock, { rpcTimeoutMs, socket: sock }));
      });
    });
  }

  async _readLoop(readable) {
    let reason = 'the server closed the connection';
    let ErrorType = ConnectionClosed;
    try {
      for await (const msg of decodeMultiStream(readable)) this._route(msg);
    } catch (e) {
      if (e instanceof ProtocolError || e instanceof DecodeError || e instanceof RangeError) {
        ErrorType = ProtocolError;
        reason = e instanceof ProtocolError ? e.message : `undecodable stream: ${e.message}`;
        this._out.destroy?.();
        readable.destroy?.();
      } else {
        reason = `read failed: ${e?.message ?? e}`;
      }
    }
    this._failAll(reason, ErrorType);
  }

  _route(msg) {
    if (!Array.isArray(msg) || msg.length === 0) {
      throw new ProtocolError(`not a MessagePack-RPC message: ${String(msg).slice(0, 200)}`);
    }
    if (msg[0] === 1 && msg.length === 4) {
      const p = typeof msg[1] === 'number' ? this._pending.get(msg[1]) : undefined;
      if (!p) return;     // e.g. the echo of a malformed msgid: not ours
      this._pending.delete(msg[1]);
      p.settle(msg[2], msg[3]);
      return;
    }
    if (msg[0] === 2 && msg.length === 3 && typeof msg[1] === 'string') {
      const args = msg[2];
      const params = Array.isArray(args) && args.length === 1 ? args[0] : args;
      if (params === null || typeof params !== 'object' || Array.isArray(params)) {
        throw new ProtocolError(`notification ${msg[1]} arguments are not [map]`);
      }
      if (msg[1] === 'call.output') {
        const p = this._pending.get(params.msgid);
        if (p?.chunks) {
          p.chunks.push({ stream: String(params.stream), data: toBuffer(params.data) });
          return;
        }
      }
      this.emit('notification', msg[1], params);
      this.emit(msg[1], params);
      return;
    }
    throw new ProtocolError(`unexpected message from the server: ${JSON.stringify(msg).slice(0, 200)}`);
  }

  _failAll(reason, ErrorType) {
    this.closed = true;
    this.closeReason = reason;
    const pending = [...this._pending.entries()];
    this._pending.clear();
    for (const [msgid, p] of pending) p.fail(new ErrorType(reason, { msgid }));
    this.emit('close', reason);
  }

  _allocate() {
    for (let i = 0; i < 1 << 20; i++) {
      const id = this._next;
      this._next = this._next >= MSGID_MAX ? 1 : this._next + 1;
      if (!this._pending.has(id)) return id;
    }
    throw new Error('no free msgid');
  }

  /** Send one request; resolves to {msgid, promise (the raw result), chunks}. */
  _send(method, params, { stream = false, timeoutMs = this.rpcTimeoutMs } = {}) {
    if (this.closed) throw new ConnectionClosed(this.closeReason ?? 'connection closed');
    const msgid = this._allocate();
    const args = params && Object.keys(params).length ? [params] : [];
    const bytes = this._encoder.encode([0, msgid, method, args]);   // throws before anything is pending
    const chunks = stream ? new ChunkQueue() : null;
    let timer = null;
    const promise = new Promise((resolve, reject) => {
      const done = () => { if (timer) clearTimeout(timer); chunks?.end(); };
      this._pending.set(msgid, {
        chunks,
        settle: (error, result) => {
          done();
          if (error !== null && error !== undefined) reject(errorFromMap(error, { msgid }));
          else resolve(result);
        },
        fail: (e) => { done(); reject(e); },
      });
      if (timeoutMs) {
        timer = setTimeout(() => {
          this._pending.get(msgid)?.fail(
            new RpcTimeout(`no response to ${method} (msgid ${msgid}) within ${timeoutMs} ms`, { msgid }));
          this._pending.delete(msgid);
        }, timeoutMs);
      }
    });
    this._out.write(bytes);
    return { msgid, promise, chunks };
  }

  /** Any method: resolves to its result, rejects with the StockadeError of the error slot. */
  request(method, params = null, opts = {}) {
    try {
      return this._send(method, params, opts).promise;
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** The server's facts: {protocol, version, policy, isolation, limits}. */
  hello(client = 'stockade-client.js') { return this.request('hello', { client }); }

  /** Open a session (or reattach to sessionId). labels: string to string, kept in logs and stats. */
  async openSession({ sessionId, ttlMs, fuseMs, labels } = {}) {
    const p = {};
    if (sessionId !== undefined) p.session_id = sessionId;
    if (ttlMs !== undefined) p.ttl_ms = ttlMs;
    if (fuseMs !== undefined) p.fuse_ms = fuseMs;
    if (labels !== undefined) p.labels = labels;
    return new Session(this, await this.request('session.open', p));
  }

  /** A Session object for an id opened elsewhere (another connection of the same uid). */
  session(sessionId) { return new Session(this, { session_id: sessionId }); }

  /**
   * Start a call; returns its CallHandle at once. opts: args, stdin, timeoutMs, deadlineMs,
   * depth, idempotent, env, stream, signal (an AbortSignal: aborting cancels the call,
   * which then answers CANCELLED), rpcTimeoutMs.
   */
  startCall(sessionId, tool, argv = [], opts = {}) {
    opts.signal?.throwIfAborted();
    const { msgid, promise, chunks } = this._send('call', callParams(sessionId, tool, argv, opts),
      { stream: Boolean(opts.stream), timeoutMs: opts.rpcTimeoutMs ?? this.rpcTimeoutMs });
    let onAbort = null;
    if (opts.signal) {
      onAbort = () => { this.cancel(msgid).catch(() => {}); };
      opts.signal.addEventListener('abort', onAbort, { once: true });
    }
    const result = promise.then(
      (m) => new CallResult(m, msgid),
      (e) => { throw e; })
      .finally(() => { if (onAbort) opts.signal.removeEventListener('abort', onAbort); });
    result.catch(() => {});   // the caller may only iterate; the rejection is theirs to await
    return new CallHandle(this, msgid, result, chunks);
  }

  /** Run one call; resolves to its CallResult (rejects only for RPC-slot errors). */
  call(sessionId, tool, argv = [], opts = {}) {
    try {
      return this.startCall(sessionId, tool, argv, opts).result;
    } catch (e) {
      return Promise.reject(e);
    }
  }

  /** Cancel the call sent with `msgid`; resolves to whether it was running. */
  async cancel(msgid) { return Boolean((await this.request('cancel', { msgid })).cancelled); }

  /** The server's counters (PROTOCOL.md, "stats"). */
  stats() { return this.request('stats'); }

  /** Re-read the server's own policy file (admin peers only): {generation, sha256}. */
  reloadPolicy() { return this.request('policy.reload'); }

  /** Close the connection; for a spawned server, wait for its exit (killed after timeoutMs). */
  async close(timeoutMs = 10000) {
    this._out.end?.();
    if (this.socket) this.socket.end();
    let code = null;
    if (this.child) {
      const child = this.child;
      const exited = child.exitCode !== null || child.signalCode !== null;
      code = exited ? child.exitCode : await new Promise((resolve) => {
        const t = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
        child.once('exit', (c, sig) => { clearTimeout(t); resolve(c ?? (sig ? -1 : null)); });
      });
    }
    await this._reading;
    return code;
  }
}
