/**
 * The REST models of the taco_notebook server extension (`/taco-notebook/api/`), mirrored once here,
 * and the checks that turn a response body into them.
 *
 * Pure: no JupyterLab import, so the unit tests run in plain Node.
 */

export type ClusterState = 'starting' | 'running' | 'stopping' | 'broken' | 'stopped' | 'stale';

export interface IClusterNode {
  node: number;
  host: string;
  ranks: number[];
  gpus: number;
  /** The model name of each GPU on the node ("NVIDIA H100 80GB HBM3"); [] on CPU nodes. */
  gpu_names: string[];
}

export interface IHugepages {
  total: number;
  free: number;
  page_kb: number;
}

export interface IClusterRun {
  cell: string;
  started_at: number;
  step: number;
  total: number | null;
  samples_per_s: number | null;
}

export interface IPendingAction {
  action: 'stop' | 'scale';
  size: number | null;
  requested_at: number;
}

/** A rank an elastic cluster lost: its rank then, its host, how it ended (`"SIGKILL"`) and when. */
export interface ILostRank {
  rank: number;
  host: string;
  how: string;
  at: number;
}

/** An elastic cluster's membership (`%%taco_run --elastic MIN:MAX`); null until an elastic cell ran. */
export interface IMembership {
  min: number;
  max: number;
  lost: ILostRank[];
  joined: number;
  blacklisted: string[];
}

/**
 * Who owns a cluster: `notebook` is the owning kernel's session path (null when unknown or server-owned),
 * `server_pid` the Jupyter server of that kernel (or the owning server itself).
 */
export interface IClusterOwner {
  kind: 'kernel' | 'server';
  pid: number;
  notebook: string | null;
  server_pid: number | null;
}

export interface IClusterModel {
  id: string;
  name: string;
  profile: string;
  owner: IClusterOwner;
  state: ClusterState;
  size: number;
  engines_up: number;
  mpi: string;
  nodes: IClusterNode[];
  gpus: number;
  hugepages: IHugepages | null;
  started_at: number | null;
  updated_at: number;
  run: IClusterRun | null;
  pending: IPendingAction | null;
  error: string | null;
  membership: IMembership | null;
  /** Whether the cluster belongs to the Jupyter server answering (absent: treat as this server's). */
  this_server: boolean;
}

/** `GET clusters`. */
export interface IClusterList {
  clusters: IClusterModel[];
}

/** `GET version`: `max_ranks` is the most ranks a cluster may have (the server's `TACO_MAX_RANKS`). */
export interface IVersion {
  version: string;
  max_ranks: number;
}

/** One rank's answer to a peek: the value's repr, the error it raised, or why no answer came. */
export type PeekAnswer =
  | { rank: number; value: string }
  | { rank: number; error: string }
  | { rank: number; missing: string };

/** `POST clusters/{id}/peek`: `text` is the readable report (one line per distinct answer, with its ranks). */
export interface IPeekResult {
  expression: string;
  seconds: number;
  text: string;
  ranks: PeekAnswer[];
}

/** The error body every 4xx/5xx of the server extension carries. */
export interface IErrorBody {
  message: string;
  reason: string;
}

export const CLUSTER_STATES: readonly ClusterState[] = [
  'starting',
  'running',
  'stopping',
  'broken',
  'stopped',
  'stale'
];

/** A response body that does not have the shape of the model it should be. */
export class InvalidResponseError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'InvalidResponseError';
  }
}

type Json = Record<string, unknown>;

function fail(path: string, expected: string, value: unknown): never {
  const got = value === null ? 'null' : Array.isArray(value) ? 'array' : typeof value;
  throw new InvalidResponseError(`${path}: expected ${expected}, got ${got}`);
}

function object(value: unknown, path: string): Json {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    fail(path, 'an object', value);
  }
  return value as Json;
}

function strValue(value: unknown, path: string): string {
  if (typeof value !== 'string') {
    fail(path, 'a string', value);
  }
  return value;
}

function numValue(value: unknown, path: string): number {
  if (typeof value !== 'number' || !Number.isFinite(value)) {
    fail(path, 'a number', value);
  }
  return value;
}

function str(obj: Json, key: string, path: string): string {
  return strValue(obj[key], `${path}.${key}`);
}

function num(obj: Json, key: string, path: string): number {
  return numValue(obj[key], `${path}.${key}`);
}

function optional<T>(obj: Json, key: string, path: string, parse: (v: unknown, p: string) => T): T | null {
  const value = obj[key];
  return value === null || value === undefined ? null : parse(value, `${path}.${key}`);
}

function oneOf<T extends string>(obj: Json, key: string, path: string, allowed: readonly T[]): T {
  const value = str(obj, key, path);
  if (!(allowed as readonly string[]).includes(value)) {
    throw new InvalidResponseError(`${path}.${key}: expected one of ${allowed.join('|')}, got '${value}'`);
  }
  return value as T;
}

function strings(value: unknown, path: string): string[] {
  if (!Array.isArray(value) || !value.every(v => typeof v === 'string')) {
    fail(path, 'an array of strings', value);
  }
  return value;
}

function boolValue(value: unknown, path: string): boolean {
  if (typeof value !== 'boolean') {
    fail(path, 'a boolean', value);
  }
  return value;
}

function nullable<T>(parse: (v: unknown, p: string) => T): (v: unknown, p: string) => T | null {
  return (value, path) => (value === null ? null : parse(value, path));
}

function parseNode(value: unknown, path: string): IClusterNode {
  const obj = object(value, path);
  const ranks = obj.ranks;
  if (!Array.isArray(ranks) || !ranks.every(r => typeof r === 'number')) {
    fail(`${path}.ranks`, 'an array of numbers', ranks);
  }
  const node: IClusterNode = {
    node: num(obj, 'node', path),
    host: str(obj, 'host', path),
    ranks,
    gpus: num(obj, 'gpus', path),
    // a node model from before GPU names were reported has none
    gpu_names: obj.gpu_names === undefined ? [] : strings(obj.gpu_names, `${path}.gpu_names`)
  };
  return node;
}

function parseHugepages(value: unknown, path: string): IHugepages {
  const obj = object(value, path);
  return { total: num(obj, 'total', path), free: num(obj, 'free', path), page_kb: num(obj, 'page_kb', path) };
}

function parseRun(value: unknown, path: string): IClusterRun {
  const obj = object(value, path);
  return {
    cell: str(obj, 'cell', path),
    started_at: num(obj, 'started_at', path),
    step: num(obj, 'step', path),
    total: optional(obj, 'total', path, numValue),
    samples_per_s: optional(obj, 'samples_per_s', path, numValue)
  };
}

function parsePending(value: unknown, path: string): IPendingAction {
  const obj = object(value, path);
  return {
    action: oneOf(obj, 'action', path, ['stop', 'scale'] as const),
    size: optional(obj, 'size', path, numValue),
    requested_at: num(obj, 'requested_at', path)
  };
}

function parseLost(value: unknown, path: string): ILostRank {
  const obj = object(value, path);
  return { rank: num(obj, 'rank', path), host: str(obj, 'host', path), how: str(obj, 'how', path), at: num(obj, 'at', path) };
}

function parseMembership(value: unknown, path: string): IMembership {
  const obj = object(value, path);
  return {
    min: num(obj, 'min', path),
    max: num(obj, 'max', path),
    lost: arrayOf(obj, 'lost', path, parseLost),
    joined: num(obj, 'joined', path),
    blacklisted: strings(obj.blacklisted, `${path}.blacklisted`)
  };
}

function parseOwner(value: unknown, path: string): IClusterOwner {
  const obj = object(value, path);
  const owner: IClusterOwner = {
    kind: oneOf(obj, 'kind', path, ['kernel', 'server'] as const),
    pid: num(obj, 'pid', path),
    notebook: nullable(strValue)(obj.notebook, `${path}.notebook`),
    server_pid: nullable(numValue)(obj.server_pid, `${path}.server_pid`)
  };
  return owner;
}

function arrayOf<T>(obj: Json, key: string, path: string, parse: (v: unknown, p: string) => T): T[] {
  const value = obj[key];
  if (!Array.isArray(value)) {
    fail(`${path}.${key}`, 'an array', value);
  }
  return value.map((item, i) => parse(item, `${path}.${key}[${i}]`));
}

/** Check one `ClusterModel`; throws {@link InvalidResponseError} naming the first bad field. */
export function parseCluster(value: unknown, path = 'cluster'): IClusterModel {
  const obj = object(value, path);
  const cluster: IClusterModel = {
    id: str(obj, 'id', path),
    name: str(obj, 'name', path),
    profile: str(obj, 'profile', path),
    owner: parseOwner(obj.owner, `${path}.owner`),
    this_server: boolValue(obj.this_server, `${path}.this_server`),
    state: oneOf(obj, 'state', path, CLUSTER_STATES),
    size: num(obj, 'size', path),
    engines_up: num(obj, 'engines_up', path),
    mpi: str(obj, 'mpi', path),
    nodes: arrayOf(obj, 'nodes', path, parseNode),
    gpus: num(obj, 'gpus', path),
    hugepages: optional(obj, 'hugepages', path, parseHugepages),
    started_at: optional(obj, 'started_at', path, numValue),
    updated_at: num(obj, 'updated_at', path),
    run: optional(obj, 'run', path, parseRun),
    pending: optional(obj, 'pending', path, parsePending),
    error: optional(obj, 'error', path, strValue),
    // absent in entries written before elastic clusters existed
    membership: optional(obj, 'membership', path, parseMembership)
  };
  return cluster;
}

/** Check a `GET clusters` body. */
export function parseClusterList(value: unknown): IClusterList {
  const obj = object(value, 'response');
  if (!Array.isArray(obj.clusters)) {
    fail('response.clusters', 'an array', obj.clusters);
  }
  return { clusters: obj.clusters.map((c, i) => parseCluster(c, `clusters[${i}]`)) };
}

/** Check a `GET version` body. */
export function parseVersion(value: unknown): IVersion {
  const obj = object(value, 'response');
  return { version: str(obj, 'version', 'response'), max_ranks: num(obj, 'max_ranks', 'response') };
}

/**
 * The message to show for an error response: the server's `message` when the body is the documented
 * `{"message", "reason"}`, else the HTTP status text.
 */
export function errorMessage(status: number, statusText: string, body: unknown): string {
  if (typeof body === 'object' && body !== null && typeof (body as Json).message === 'string') {
    const message = ((body as Json).message as string).trim();
    if (message) {
      return message;
    }
  }
  if (typeof body === 'string' && body.trim() && !body.trimStart().startsWith('<')) {
    return body.trim();
  }
  return `HTTP ${status}${statusText ? ` ${statusText}` : ''}`;
}

/** The readable report of a `stacks` answer (its `text`); the rest of the answer is for programs. */
export function parseStacksText(body: unknown): string {
  const text = typeof body === 'object' && body !== null ? (body as { text?: unknown }).text : undefined;
  if (typeof text !== 'string') {
    throw new InvalidResponseError(`stacks.text: expected a string, got ${typeof text}`);
  }
  return text;
}

const PEEK_KINDS = ['value', 'error', 'missing'] as const;

function parsePeekAnswer(value: unknown, path: string): PeekAnswer {
  const obj = object(value, path);
  const rank = num(obj, 'rank', path);
  const kind = PEEK_KINDS.find(k => k in obj);
  if (kind === undefined) {
    throw new InvalidResponseError(`${path}: expected one of ${PEEK_KINDS.join('|')}, got none`);
  }
  const said = str(obj, kind, path);
  return kind === 'value' ? { rank, value: said } : kind === 'error' ? { rank, error: said } : { rank, missing: said };
}

/** Check a `peek` answer; throws {@link InvalidResponseError} naming the first bad field. */
export function parsePeek(value: unknown): IPeekResult {
  const obj = object(value, 'peek');
  return {
    expression: str(obj, 'expression', 'peek'),
    seconds: num(obj, 'seconds', 'peek'),
    text: str(obj, 'text', 'peek'),
    ranks: arrayOf(obj, 'ranks', 'peek', parsePeekAnswer)
  };
}
