/**
 * How the sidebar polls: the interval, the backoff after failures, and which failures are worth telling the
 * user about (once per kind, not once per poll).
 *
 * Pure: no JupyterLab import, so the unit tests run in plain Node.
 */

/** Poll `GET clusters` this often while all is well. */
export const POLL_INTERVAL_MS = 2000;

/** Poll this often while some cluster runs a cell: its step then trails the cell's by under a second. */
export const LIVE_POLL_INTERVAL_MS = 500;

/** The wait before the next poll after a good one: short while a cell runs, else the resting interval. */
export function pollInterval(clusters: ReadonlyArray<{ run: unknown }>): number {
  return clusters.some(cluster => cluster.run) ? LIVE_POLL_INTERVAL_MS : POLL_INTERVAL_MS;
}

/** Never wait longer than this between polls, however long the server has been failing. */
export const MAX_POLL_INTERVAL_MS = 30000;

/** Each consecutive failure multiplies the wait by this. */
export const BACKOFF_GROWTH = 2;

/**
 * The wait before the next poll after `failures` consecutive failures: 2 s, 4 s, 8 s, 16 s, then 30 s.
 * Deterministic (no jitter): one browser tab polls one server.
 */
export function backoffDelay(
  failures: number,
  base = POLL_INTERVAL_MS,
  max = MAX_POLL_INTERVAL_MS,
  growth = BACKOFF_GROWTH
): number {
  if (!(failures > 0)) {
    return base;
  }
  // Cap the exponent so the power cannot overflow before the min() applies.
  const exponent = Math.min(failures, 64);
  return Math.min(max, Math.round(base * Math.pow(growth, exponent)));
}

/** What went wrong, coarsely: one message per kind is enough. */
export type FailureKind = 'network' | 'not-found' | 'forbidden' | 'client' | 'server' | 'invalid-response';

/** Classify a failed request by its HTTP status (`null`: no response at all) or a malformed body. */
export function failureKind(status: number | null, invalidResponse = false): FailureKind {
  if (invalidResponse) {
    return 'invalid-response';
  }
  if (status === null || status === 0) {
    return 'network';
  }
  if (status === 404) {
    return 'not-found';
  }
  if (status === 401 || status === 403) {
    return 'forbidden';
  }
  return status >= 500 ? 'server' : 'client';
}

/**
 * Remembers which kinds of failure were already reported since the last success, so a server that fails
 * every poll produces one message, not one per poll.
 *
 * ```ts
 * if (latch.report(kind)) { console.warn(...) }   // true once per kind
 * latch.clear();                                 // after a successful poll
 * ```
 */
export class FailureLatch {
  private readonly _reported = new Set<string>();

  /** `true` the first time `kind` fails since the last {@link clear}. */
  report(kind: string): boolean {
    if (this._reported.has(kind)) {
      return false;
    }
    this._reported.add(kind);
    return true;
  }

  /** Forget every failure: the next one is reported again. */
  clear(): void {
    this._reported.clear();
  }

  /** The kinds reported since the last {@link clear}. */
  get kinds(): string[] {
    return [...this._reported];
  }
}
