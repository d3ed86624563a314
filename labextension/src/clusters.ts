/**
 * The sidebar's model: the clusters the server extension reports, kept fresh by a {@link Poll}, and the
 * actions on them.
 */

import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { IClusterModel, IPeekResult } from './models';
import { backoffDelay, FailureLatch, MAX_POLL_INTERVAL_MS, pollInterval, POLL_INTERVAL_MS } from './poll';
import { ApiError, ClusterAPI } from './request';

/** Whether the server extension answers: `missing` when `GET version` is a 404. */
export type ServerStatus = 'unknown' | 'ok' | 'missing';

export class ClusterManager implements IDisposable {
  private readonly _api: ClusterAPI;
  private readonly _poll: Poll;
  private readonly _changed = new Signal<this, void>(this);
  private readonly _latch = new FailureLatch();
  private _clusters: IClusterModel[] = [];
  private _serverStatus: ServerStatus = 'unknown';
  private _pollError: ApiError | null = null;
  private _failures = 0;
  private _loaded = false;
  private _maxRanks: number | null = null;

  /**
   * @param isVisible - polling stands by while this returns false (the sidebar is collapsed), as it does
   *   while the browser tab is hidden.
   */
  constructor(api: ClusterAPI, isVisible: () => boolean = () => true) {
    this._api = api;
    this._poll = new Poll({
      auto: true,
      factory: () => this._update(),
      frequency: { interval: POLL_INTERVAL_MS, backoff: false, max: MAX_POLL_INTERVAL_MS },
      name: 'taco-notebook:clusters',
      standby: () => (isVisible() ? 'when-hidden' : true)
    });
  }

  /** Emitted after every poll and action. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get clusters(): readonly IClusterModel[] {
    return this._clusters;
  }

  get serverStatus(): ServerStatus {
    return this._serverStatus;
  }

  /** Whether one poll succeeded: until then an empty list means "not known yet", not "no clusters". */
  get loaded(): boolean {
    return this._loaded;
  }

  /** The server's limit on a cluster's size (`GET version`'s `max_ranks`), `null` when it does not say. */
  get maxRanks(): number | null {
    return this._maxRanks;
  }

  /** The failure of the latest poll; `null` once a poll succeeds again. */
  get pollError(): ApiError | null {
    return this._pollError;
  }

  /** Milliseconds until the next poll while polls fail (the backoff), else `null`. */
  get retryDelay(): number | null {
    return this._failures > 0 ? backoffDelay(this._failures) : null;
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  /** Poll now and resolve once the result is in. */
  async refresh(): Promise<void> {
    await this._poll.refresh();
    await this._poll.tick;
  }

  /** Start a cluster of `size` engines. Errors reach the caller, which shows them. */
  async start(size: number): Promise<IClusterModel> {
    try {
      return await this._api.start(size);
    } finally {
      void this.refresh();
    }
  }

  async stop(id: string): Promise<void> {
    try {
      await this._api.stop(id);
    } finally {
      void this.refresh();
    }
  }

  /** The hang autopsy of cluster `id`, read from its ranks while a cell runs (nothing is stopped or changed). */
  async stacks(id: string): Promise<string> {
    return this._api.stacks(id);
  }

  /** `expr` evaluated on the ranks of cluster `id` while a cell runs (the cell is neither stopped nor waited for). */
  async peek(id: string, expr: string, ranks?: number[], timeout?: number): Promise<IPeekResult> {
    return this._api.peek(id, expr, ranks, timeout);
  }

  async scale(id: string, size: number): Promise<void> {
    try {
      await this._api.scale(id, size);
    } finally {
      void this.refresh();
    }
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    Signal.clearData(this);
  }

  /** One poll. Never rejects: failures set the backoff and the error the panel shows. */
  private async _update(): Promise<void> {
    if (this._serverStatus === 'missing') {
      // Enabling the server extension needs a server restart, which reloads the page: stop asking.
      void this._poll.stop();
      return;
    }
    try {
      if (this._serverStatus !== 'ok') {
        const version = await this._api.version();
        this._maxRanks = version.max_ranks ?? null;
        this._serverStatus = 'ok';
      }
      this._clusters = await this._api.list();
      this._loaded = true;
      this._failures = 0;
      this._pollError = null;
      this._latch.clear();
      this._setInterval(pollInterval(this._clusters));
    } catch (error) {
      this._onPollError(error);
    }
    this._changed.emit();
  }

  private _onPollError(error: unknown): void {
    const apiError =
      error instanceof ApiError ? error : new ApiError(`Unexpected error: ${String(error)}`, 200, '', true);
    if (apiError.status === 404 && this._serverStatus !== 'ok') {
      this._serverStatus = 'missing';
      this._pollError = null;
      void this._poll.stop();
      return;
    }
    if (apiError.status === 404) {
      // The server may have restarted without the extension: check `GET version` again next time.
      this._serverStatus = 'unknown';
    }
    this._failures += 1;
    this._pollError = apiError;
    if (this._latch.report(apiError.kind)) {
      console.warn(`taco-notebook: polling clusters failed (${apiError.kind}); backing off`, apiError);
    }
    this._setInterval(backoffDelay(this._failures));
  }

  /** The wait before the next poll; our own deterministic backoff rather than the Poll's random one. */
  private _setInterval(interval: number): void {
    this._poll.frequency = { interval, backoff: false, max: MAX_POLL_INTERVAL_MS };
  }
}
