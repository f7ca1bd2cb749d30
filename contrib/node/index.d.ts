// Types of stockade-client (index.js): the protocol-2 client of `stockade serve`.
import { EventEmitter } from 'node:events';
import type { Readable, Writable } from 'node:stream';

export declare const PROTOCOL_VERSION: 2;

export type ErrorClassName =
  | 'TOOL_ERROR' | 'TOOL_TIMEOUT' | 'DEADLINE_EXCEEDED' | 'SESSION_EXPIRED'
  | 'POLICY_VIOLATION' | 'RESOURCE_LIMIT' | 'OUTPUT_REJECTED' | 'CANCELLED' | 'OVERLOADED'
  | 'BAD_REQUEST' | 'NO_SUCH_SESSION' | 'INTERNAL';
export type ResultClassName = 'OK' | ErrorClassName;
export type Layer = 'deadline' | 'timeout' | 'cpu' | 'fuse' | 'ttl';

/** The protocol's error map. */
export interface ErrorMap {
  class: string;
  retryable: boolean;
  message: string;
  layer: string | null;
}

export declare class StockadeError extends Error {
  static readonly CLASS: string;
  /** The stable, machine-readable class (e.g. 'BAD_REQUEST'). */
  readonly class: string;
  readonly retryable: boolean;
  readonly layer: string | null;
  readonly raw: ErrorMap | null;
  readonly msgid: number | null;
  /** The CallResult this was raised for (CallResult.raiseForClass), else null. */
  readonly result: CallResult | null;
}
export declare class ToolError extends StockadeError {}
export declare class ToolTimeout extends StockadeError {}
export declare class DeadlineExceeded extends StockadeError {}
export declare class SessionExpired extends StockadeError {}
export declare class PolicyViolation extends StockadeError {}
export declare class ResourceLimit extends StockadeError {}
export declare class OutputRejected extends StockadeError {}
export declare class Cancelled extends StockadeError {}
export declare class Overloaded extends StockadeError {}
export declare class BadRequest extends StockadeError {}
export declare class NoSuchSession extends StockadeError {}
export declare class Internal extends StockadeError {}
export declare class UnknownErrorClass extends StockadeError {}
export declare class ConnectionClosed extends StockadeError {}
export declare class ProtocolError extends StockadeError {}
export declare class RpcTimeout extends StockadeError {}
export declare const ERROR_CLASSES: Record<ErrorClassName, typeof StockadeError>;
export declare function errorFromMap(err: unknown, opts?: { msgid?: number; result?: CallResult }): StockadeError;

/** The result of a call, also when the tool failed or was refused by the policy. */
export declare class CallResult {
  readonly raw: Record<string, unknown>;
  readonly msgid: number | null;
  readonly class: ResultClassName;
  readonly retryable: boolean;
  readonly message: string;
  readonly layer: Layer | null;
  readonly exitCode: number | null;
  readonly signal: number | null;
  readonly stdout: Buffer;
  readonly stderr: Buffer;
  readonly truncated: { stdout: number; stderr: number };
  readonly redactions: number;
  readonly durationMs: number;
  readonly cpuMs: number;
  readonly maxRssKb: number;
  /** class === 'OK' */
  readonly ok: boolean;
  /** Throws the matching StockadeError unless OK. */
  raiseForClass(): this;
}

export interface OutputChunk {
  stream: 'stdout' | 'stderr';
  data: Buffer;
}

export interface CallOptions {
  /** Structured arguments (the tool's JSON Schema), instead of argv. */
  args?: Record<string, unknown>;
  stdin?: Uint8Array | string;
  timeoutMs?: number;
  deadlineMs?: number;
  depth?: number;
  idempotent?: boolean;
  env?: Record<string, string>;
  /** Stream output as it comes: iterate the CallHandle. */
  stream?: boolean;
  /** Aborting cancels the call on the server; it then answers class CANCELLED. */
  signal?: AbortSignal;
  rpcTimeoutMs?: number;
}

/** A call in flight. */
export declare class CallHandle implements AsyncIterable<OutputChunk> {
  readonly client: Client;
  readonly msgid: number;
  readonly result: Promise<CallResult>;
  cancel(): Promise<boolean>;
  [Symbol.asyncIterator](): AsyncIterator<OutputChunk>;
}

export interface ServerInfo {
  protocol: number;
  version: string;
  policy: { name: string; sha256: string; generation: number };
  isolation: { level: string; layers: string[] };
  limits: { max_sessions: number; max_running: number; max_message: number };
}

export interface SessionOptions {
  sessionId?: string;
  ttlMs?: number;
  fuseMs?: number;
  labels?: Record<string, string>;
}

export declare class Session {
  readonly client: Client;
  readonly id: string;
  readonly root: string | null;
  expiresAtMs: number | null;
  readonly fuseAtMs: number | null;
  closed: boolean;
  call(tool: string, argv?: string[], opts?: CallOptions): Promise<CallResult>;
  startCall(tool: string, argv?: string[], opts?: CallOptions): CallHandle;
  stream(tool: string, argv?: string[], opts?: CallOptions): CallHandle;
  renew(): Promise<number>;
  close(): Promise<{ removed: boolean; calls_killed: number }>;
}

export interface ClientOptions {
  rpcTimeoutMs?: number | null;
}

export declare class Client extends EventEmitter {
  constructor(readable: Readable, writable: Writable, opts?: ClientOptions);
  static spawn(argv: string[], opts?: ClientOptions & {
    stderr?: 'inherit' | 'ignore' | 'pipe' | number; env?: NodeJS.ProcessEnv;
  }): Client;
  static connectUnix(path: string, opts?: ClientOptions): Promise<Client>;
  readonly closed: boolean;
  readonly closeReason: string | null;
  rpcTimeoutMs: number | null;
  request<T = any>(method: string, params?: Record<string, unknown> | null,
                   opts?: { timeoutMs?: number | null }): Promise<T>;
  hello(client?: string): Promise<ServerInfo>;
  openSession(opts?: SessionOptions): Promise<Session>;
  session(sessionId: string): Session;
  startCall(sessionId: string, tool: string, argv?: string[], opts?: CallOptions): CallHandle;
  call(sessionId: string, tool: string, argv?: string[], opts?: CallOptions): Promise<CallResult>;
  cancel(msgid: number): Promise<boolean>;
  stats(): Promise<Record<string, any>>;
  reloadPolicy(): Promise<{ generation: number; sha256: string }>;
  close(timeoutMs?: number): Promise<number | null>;
  on(event: 'notification', listener: (method: string, params: Record<string, any>) => void): this;
  on(event: 'session.expired', listener: (params: { session_id: string; layer: string }) => void): this;
  on(event: 'alarm', listener: (params: Record<string, any>) => void): this;
  on(event: 'close', listener: (reason: string) => void): this;
  on(event: string, listener: (...args: any[]) => void): this;
}
