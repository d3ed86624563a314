/**
 * Calls to the taco_notebook server extension's REST API (`/taco-notebook/api/`).
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  errorMessage,
  IClusterModel,
  InvalidResponseError,
  IPeekResult,
  IVersion,
  parseCluster,
  parseClusterList,
  parsePeek,
  parseStacksText,
  parseVersion
} from './models';
import { failureKind, FailureKind } from './poll';

/** The API's path below the server's base URL. */
export const API_NAMESPACE = 'taco-notebook/api';

/** A failed call: `status` is `null` when no response came back at all. */
export class ApiError extends Error {
  readonly status: number | null;
  readonly reason: string;
  readonly kind: FailureKind;

  constructor(message: string, status: number | null, reason = '', invalidResponse = false) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.reason = reason;
    this.kind = failureKind(status, invalidResponse);
  }
}

/**
 * Call `endPoint` (relative to {@link API_NAMESPACE}) and return the parsed JSON body (`null` when empty).
 * Throws {@link ApiError} for a network failure, a 4xx/5xx (with the server's message) or a non-JSON body.
 */
export async function requestAPI(
  endPoint: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<unknown> {
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(`Cannot reach the Jupyter server: ${(error as Error).message ?? error}`, null);
  }
  const text = await response.text();
  let body: unknown = null;
  if (text.length > 0) {
    try {
      body = JSON.parse(text);
    } catch {
      body = text;
    }
  }
  if (!response.ok) {
    const reason =
      typeof body === 'object' && body !== null && typeof (body as { reason?: unknown }).reason === 'string'
        ? (body as { reason: string }).reason
        : '';
    throw new ApiError(errorMessage(response.status, response.statusText, body), response.status, reason);
  }
  if (typeof body === 'string') {
    throw new ApiError(`${init.method ?? 'GET'} ${endPoint}: the response is not JSON`, response.status, '', true);
  }
  return body;
}

/** Run `parse` on a response body, turning a shape mismatch into an {@link ApiError}. */
function checked<T>(endPoint: string, body: unknown, parse: (body: unknown) => T): T {
  try {
    return parse(body);
  } catch (error) {
    if (error instanceof InvalidResponseError) {
      throw new ApiError(`Unexpected response from ${endPoint}: ${error.message}`, 200, '', true);
    }
    throw error;
  }
}

function jsonInit(method: string, payload?: unknown): RequestInit {
  return payload === undefined ? { method } : { method, body: JSON.stringify(payload) };
}

/** The client of the cluster API; one per sidebar. */
export class ClusterAPI {
  constructor(private readonly _settings: ServerConnection.ISettings) {}

  /** `GET version`: a 404 here means the server extension is not enabled. */
  async version(): Promise<IVersion> {
    return checked('version', await requestAPI('version', {}, this._settings), parseVersion);
  }

  async list(): Promise<IClusterModel[]> {
    return checked('clusters', await requestAPI('clusters', {}, this._settings), parseClusterList).clusters;
  }

  async get(id: string): Promise<IClusterModel> {
    const endPoint = `clusters/${encodeURIComponent(id)}`;
    return checked(endPoint, await requestAPI(endPoint, {}, this._settings), parseCluster);
  }

  /** `POST clusters`: starts a cluster of `size` engines; returns it in state `starting`. */
  async start(size: number): Promise<IClusterModel> {
    return checked('clusters', await requestAPI('clusters', jsonInit('POST', { size }), this._settings), parseCluster);
  }

  /** `DELETE clusters/{id}`: asks the cluster to stop. */
  async stop(id: string): Promise<void> {
    await requestAPI(`clusters/${encodeURIComponent(id)}`, jsonInit('DELETE'), this._settings);
  }

  /** `GET clusters/{id}/stacks`: the hang autopsy (every rank's stack and collective, grouped), as text. */
  async stacks(id: string): Promise<string> {
    const endPoint = `clusters/${encodeURIComponent(id)}/stacks`;
    return checked(endPoint, await requestAPI(endPoint, {}, this._settings), parseStacksText);
  }

  /**
   * `POST clusters/{id}/peek`: `expr` evaluated on each rank (all, or `ranks`) by its listener thread while a cell
   * runs, waiting at most `timeout` seconds (0, 5] for each (the server's default: 1 s).
   */
  async peek(id: string, expr: string, ranks?: number[], timeout?: number): Promise<IPeekResult> {
    const endPoint = `clusters/${encodeURIComponent(id)}/peek`;
    const payload = { expr, ...(ranks === undefined ? {} : { ranks }), ...(timeout === undefined ? {} : { timeout }) };
    return checked(endPoint, await requestAPI(endPoint, jsonInit('POST', payload), this._settings), parsePeek);
  }

  /** `PATCH clusters/{id}`: asks the cluster to grow or shrink to `size` engines. */
  async scale(id: string, size: number): Promise<void> {
    await requestAPI(`clusters/${encodeURIComponent(id)}`, jsonInit('PATCH', { size }), this._settings);
  }
}
