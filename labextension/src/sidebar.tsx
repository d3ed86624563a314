/**
 * The "TACO clusters" left sidebar: one row per cluster with its state, engines, nodes, GPUs, hugepages and
 * current run, and the buttons that start, scale and stop clusters or insert a `%%taco_run` cell.
 *
 * The DOM contract browser tests rely on (keep it stable):
 * - `#taco-notebook-sidebar` the panel; `.taco-new-cluster` its "New cluster" button; `.taco-server-missing` the
 *   message shown instead of the list when `GET version` is a 404; `.taco-poll-error` the banner while polls fail.
 * - `li.taco-cluster[data-cluster-id][data-cluster-name][data-state]` one row per cluster, with
 *   `.taco-cluster-name`, `.taco-cluster-owner` (the owning notebook, full path in its title),
 *   `.taco-cluster-state` (badge), `.taco-cluster-engines` (text `up/size`), `.taco-cluster-nodes`,
 *   `.taco-cluster-gpus` (with `.taco-cluster-gpu-names` lines when nodes report model names),
 *   `.taco-cluster-hugepages`, `.taco-cluster-mpi` (one line, full text in its title), `.taco-cluster-run` >
 *   `.taco-cluster-cell`, `.taco-cluster-step`, `.taco-cluster-throughput`, `.taco-cluster-error` (the server's
 *   explanation, e.g. of a stale entry). While a cell runs, under it `.taco-cluster-run-actions` >
 *   `.taco-cluster-stacks` (the hang autopsy in a dialog, `pre.taco-stacks-text`) and `.taco-cluster-peek` (a
 *   dialog `.taco-peek-dialog` with `input.taco-peek-input`, `button.taco-peek-run`, `pre.taco-peek-text` and
 *   `.taco-peek-error`). Then `.taco-cluster-actions` > `.taco-cluster-insert`, `.taco-cluster-scale`,
 *   `.taco-cluster-stop` (labelled "Remove" on a stale row).
 * - Rows of this Jupyter server sit in `ul.taco-cluster-list`; those of other servers in
 *   `details.taco-other-servers` (collapsed at first) > `ul.taco-other-list`.
 * - Size dialogs: `.jp-Dialog input.taco-size-input` and the accept button `.jp-Dialog .jp-mod-accept` (disabled
 *   while the input is invalid). Stop and scale-down ask first: `.jp-Dialog` with `.jp-mod-accept` (a warn
 *   button) to go ahead.
 */

import { showErrorMessage } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { LabIcon, ReactWidget } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { ISignal } from '@lumino/signaling';
import React, { useEffect, useState } from 'react';

import { ClusterManager } from './clusters';
import { askSize, confirmScaleDown, confirmStop, showPeek, showStacks } from './dialogs';
import {
  cellSnippet,
  formatElapsed,
  formatEngines,
  formatHosts,
  formatHugepages,
  formatMembership,
  formatNodeCount,
  formatProgress,
  formatThroughput,
  gpuNameLines,
  isScaleDown,
  NONE,
  ownerDescription,
  ownerLabel,
  sizeCap,
  splitByServer,
  stateDescription,
  stateLabel,
  tacoRunHeader
} from './format';
import { IClusterModel } from './models';

/** The sidebar's widget id (`#taco-notebook-sidebar`). */
export const SIDEBAR_ID = 'taco-notebook-sidebar';

/** The new-cluster dialog's default size. */
const DEFAULT_NEW_SIZE = 4;

export const SERVER_MISSING_MESSAGE =
  'The taco_notebook server extension is not enabled: run `jupyter server extension enable taco_notebook` ' +
  'and restart JupyterLab';

const TACO_SVG = `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16" height="16">
  <path class="jp-icon3" fill="#616161" d="M12 5C6.5 5 2 9.5 2 15v3h20v-3c0-5.5-4.5-10-10-10zm0 2c4.1 0 7.5 3.1 7.9
  7H4.1C4.5 10.1 7.9 7 12 7zM4 16h16v0.1H4z"/>
  <circle class="jp-icon3" fill="#616161" cx="8" cy="11" r="1.2"/>
  <circle class="jp-icon3" fill="#616161" cx="12" cy="9.6" r="1.2"/>
  <circle class="jp-icon3" fill="#616161" cx="16" cy="11" r="1.2"/>
</svg>`;

export const tacoIcon = new LabIcon({ name: 'taco-notebook:taco', svgstr: TACO_SVG });

/** What the buttons act on. */
interface IActions {
  manager: ClusterManager;
  tracker: INotebookTracker | null;
  activate: (id: string) => void;
}

/** Re-render whenever `signal` fires. */
function useSignalRender(signal: ISignal<unknown, unknown> | null): void {
  const [, setCount] = useState(0);
  useEffect(() => {
    if (!signal) {
      return;
    }
    const slot = () => setCount(count => count + 1);
    signal.connect(slot);
    return () => {
      signal.disconnect(slot);
    };
  }, [signal]);
}

/** Run an action, showing its failure in one dialog. */
async function runAction(title: string, action: () => Promise<unknown>): Promise<void> {
  try {
    await action();
  } catch (error) {
    await showErrorMessage(title, (error as Error).message ?? String(error));
  }
}

/** Insert `%%taco_run -np N --cluster NAME` as a new code cell below the active cell of the current notebook. */
export function insertTacoRunCell(actions: IActions, cluster: IClusterModel): boolean {
  const panel = actions.tracker?.currentWidget;
  if (!panel) {
    return false;
  }
  const notebook = panel.content;
  NotebookActions.insertBelow(notebook);
  NotebookActions.changeCellType(notebook, 'code');
  const cell = notebook.activeCell;
  if (!cell) {
    return false;
  }
  cell.model.sharedModel.setSource(tacoRunHeader(cluster));
  // The magic needs the extension in that kernel: load it quietly (a no-op when it is loaded already).
  const kernel = panel.sessionContext.session?.kernel;
  kernel
    ?.requestExecute({ code: '%load_ext taco_notebook', silent: true, store_history: false })
    .done.catch(() => undefined);
  actions.activate(panel.id);
  // Activating the panel focuses the notebook in command mode; once that is done, put the cursor on the line
  // after the magic, ready to type the cell's code.
  requestAnimationFrame(() => {
    if (notebook.isDisposed || notebook.activeCell !== cell) {
      return;
    }
    notebook.mode = 'edit';
    cell.editor?.setCursorPosition({ line: 1, column: 0 });
    cell.editor?.focus();
  });
  return true;
}

function ClusterRun({ run }: { run: NonNullable<IClusterModel['run']> }): JSX.Element {
  return (
    <div className="taco-cluster-run">
      <code className="taco-cluster-cell" title={run.cell}>
        {cellSnippet(run.cell) || NONE}
      </code>
      <span className="taco-cluster-step" title={`running for ${formatElapsed(run.started_at, Date.now() / 1000)}`}>
        {formatProgress(run)}
      </span>
      {run.samples_per_s === null ? null : (
        <span className="taco-cluster-throughput">{formatThroughput(run.samples_per_s)}</span>
      )}
    </div>
  );
}

function ClusterRow({ cluster, actions }: { cluster: IClusterModel; actions: IActions }): JSX.Element {
  const [busy, setBusy] = useState(false);
  const hasNotebook = !!actions.tracker?.currentWidget;
  const settled = cluster.state === 'stopped' || cluster.state === 'stopping' || cluster.pending?.action === 'stop';
  const stale = cluster.state === 'stale';
  const gpuNames = gpuNameLines(cluster.nodes);
  const membership = formatMembership(cluster.membership);
  const canScale = cluster.state === 'running' && !cluster.pending;

  const act = (title: string, action: () => Promise<unknown>) => {
    setBusy(true);
    void runAction(title, action).finally(() => setBusy(false));
  };
  const onStop = () =>
    act(`Could not stop cluster ${cluster.name}`, async () => {
      if (!(await confirmStop(cluster))) {
        return;
      }
      await actions.manager.stop(cluster.id);
    });
  const onScale = () =>
    act(`Could not scale cluster ${cluster.name}`, async () => {
      const size = await askSize({
        title: `Scale cluster ${cluster.name}`,
        label: 'Number of engines (MPI ranks)',
        initial: cluster.size,
        acceptLabel: 'Scale',
        max: sizeCap(actions.manager.maxRanks)
      });
      if (size === null || (isScaleDown(cluster, size) && !(await confirmScaleDown(cluster, size)))) {
        return;
      }
      await actions.manager.scale(cluster.id, size);
    });
  const onStacks = () =>
    act(`Could not read the stacks of cluster ${cluster.name}`, async () => {
      await showStacks(cluster, await actions.manager.stacks(cluster.id));
    });
  const onPeek = () =>
    act(`Could not peek into cluster ${cluster.name}`, () =>
      showPeek(cluster, expr => actions.manager.peek(cluster.id, expr))
    );
  const onInsert = () => {
    insertTacoRunCell(actions, cluster);
  };

  return (
    <li
      className={`taco-cluster taco-state-${cluster.state}`}
      data-cluster-id={cluster.id}
      data-cluster-name={cluster.name}
      data-state={cluster.state}
    >
      <div className="taco-cluster-header">
        <span className="taco-cluster-title">
          <span className="taco-cluster-name" title={`${cluster.name} (profile ${cluster.profile}, id ${cluster.id})`}>
            {cluster.name}
          </span>
          <span className="taco-cluster-owner" title={ownerDescription(cluster)}>
            {ownerLabel(cluster)}
          </span>
        </span>
        <span className={`taco-cluster-state taco-badge taco-badge-${cluster.state}`} title={stateDescription(cluster)}>
          {stateLabel(cluster)}
        </span>
      </div>
      <dl className="taco-cluster-details">
        <dt>Engines</dt>
        <dd className="taco-cluster-engines">{formatEngines(cluster)}</dd>
        <dt>Nodes</dt>
        <dd className="taco-cluster-nodes">
          {formatNodeCount(cluster.nodes.length)}
          {cluster.nodes.length ? `: ${formatHosts(cluster.nodes)}` : ''}
        </dd>
        <dt>GPUs</dt>
        <dd className="taco-cluster-gpus">
          {cluster.gpus}
          {gpuNames.map(line => (
            <span key={line} className="taco-cluster-gpu-names" title={line}>
              {line}
            </span>
          ))}
        </dd>
        <dt>Hugepages</dt>
        <dd className="taco-cluster-hugepages">{formatHugepages(cluster.hugepages)}</dd>
        <dt>MPI</dt>
        <dd className="taco-cluster-mpi" title={cluster.mpi || undefined}>
          {cluster.mpi || NONE}
        </dd>
        {membership ? <dt>Membership</dt> : null}
        {membership ? <dd className="taco-cluster-membership">{membership}</dd> : null}
      </dl>
      {cluster.run ? <ClusterRun run={cluster.run} /> : null}
      {cluster.run ? (
        <div className="taco-cluster-run-actions">
          <button
            className="taco-cluster-stacks jp-Button jp-mod-styled jp-mod-reject"
            disabled={busy}
            title="Where every rank is now: its stack and the collective it waits in (changes nothing)"
            onClick={onStacks}
          >
            Stacks
          </button>
          <button
            className="taco-cluster-peek jp-Button jp-mod-styled jp-mod-reject"
            disabled={busy}
            title="Evaluate a Python expression on every rank while the cell runs (loss.item(), a step counter)"
            onClick={onPeek}
          >
            Peek
          </button>
        </div>
      ) : null}
      {cluster.error ? <div className="taco-cluster-error">{cluster.error}</div> : null}
      <div className="taco-cluster-actions">
        <button
          className="taco-cluster-insert jp-Button jp-mod-styled jp-mod-reject"
          disabled={!hasNotebook}
          title={
            hasNotebook
              ? `Insert a %%taco_run cell for ${cluster.name} below the active cell`
              : 'Open a notebook to insert a %%taco_run cell'
          }
          onClick={onInsert}
        >
          Insert cell
        </button>
        <button
          className="taco-cluster-scale jp-Button jp-mod-styled jp-mod-reject"
          disabled={busy || !canScale}
          title={canScale ? 'Change the number of engines' : 'Only a running cluster with nothing pending can scale'}
          onClick={onScale}
        >
          Scale
        </button>
        <button
          className="taco-cluster-stop jp-Button jp-mod-styled jp-mod-warn"
          disabled={busy || settled}
          title={
            settled
              ? 'Already stopping'
              : stale
                ? 'Remove this stale entry (and end any engine its kernel left running)'
                : 'Stop the engines and the controller'
          }
          onClick={onStop}
        >
          {stale ? 'Remove' : 'Stop'}
        </button>
      </div>
    </li>
  );
}

function PollStatus({ manager }: { manager: ClusterManager }): JSX.Element | null {
  const error = manager.pollError;
  if (!error) {
    return null;
  }
  const retry = manager.retryDelay;
  return (
    <div className="taco-poll-error" role="status">
      {error.message}
      {retry !== null ? ` (retrying in ${Math.round(retry / 1000)} s)` : ''}
    </div>
  );
}

/** Clusters of other Jupyter servers of this user: apart, and collapsed until asked for. */
function OtherServers({ clusters, actions }: { clusters: IClusterModel[]; actions: IActions }): JSX.Element {
  return (
    <details className="taco-other-servers">
      <summary title="Clusters started by kernels of other Jupyter servers you run on this machine">
        Other Jupyter servers ({clusters.length})
      </summary>
      <ul className="taco-other-list">
        {clusters.map(cluster => (
          <ClusterRow key={cluster.id} cluster={cluster} actions={actions} />
        ))}
      </ul>
    </details>
  );
}

function ClusterPanel({ actions }: { actions: IActions }): JSX.Element {
  const { manager, tracker } = actions;
  useSignalRender(manager.changed);
  useSignalRender(tracker?.currentChanged ?? null);
  const [starting, setStarting] = useState(false);

  const onNew = () => {
    setStarting(true);
    void runAction('Could not start a cluster', async () => {
      const size = await askSize({
        title: 'New cluster',
        label: 'Number of engines (MPI ranks)',
        initial: DEFAULT_NEW_SIZE,
        acceptLabel: 'Start',
        max: sizeCap(manager.maxRanks)
      });
      if (size !== null) {
        await manager.start(size);
      }
    }).finally(() => setStarting(false));
  };

  const missing = manager.serverStatus === 'missing';
  const { mine, others } = splitByServer(manager.clusters);
  return (
    <div className="taco-sidebar-content">
      <header className="taco-sidebar-header">
        <h2>TACO clusters</h2>
        <button
          className="taco-new-cluster jp-Button jp-mod-styled jp-mod-accept"
          disabled={missing || starting}
          title="Start a new MPI cluster of ipyparallel engines"
          onClick={onNew}
        >
          New cluster
        </button>
      </header>
      {missing ? <div className="taco-server-missing">{SERVER_MISSING_MESSAGE}</div> : <PollStatus manager={manager} />}
      {!missing && manager.loaded && mine.length === 0 ? (
        <p className="taco-empty">No clusters yet: start one here, or run a %%taco_run cell.</p>
      ) : null}
      <ul className="taco-cluster-list">
        {mine.map(cluster => (
          <ClusterRow key={cluster.id} cluster={cluster} actions={actions} />
        ))}
      </ul>
      {others.length ? <OtherServers clusters={others} actions={actions} /> : null}
    </div>
  );
}

/** The sidebar widget; polls only while shown. */
export class ClusterSidebar extends ReactWidget {
  private readonly _actions: IActions;

  constructor(actions: IActions) {
    super();
    this._actions = actions;
    this.id = SIDEBAR_ID;
    this.addClass('taco-sidebar');
    this.title.icon = tacoIcon;
    this.title.caption = 'TACO clusters';
  }

  get manager(): ClusterManager {
    return this._actions.manager;
  }

  render(): JSX.Element {
    return <ClusterPanel actions={this._actions} />;
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._actions.manager.refresh();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._actions.manager.dispose();
    super.dispose();
  }
}
