/**
 * What the sidebar shows for a cluster, as plain strings.
 *
 * Pure: no JupyterLab import, so the unit tests run in plain Node.
 */

import type { IClusterModel, IClusterNode, IClusterRun, IHugepages, IMembership } from './models';

/** Shown where a value is unknown. */
export const NONE = '—';

/** `"3/4"`: engines registered out of the cluster's size. */
export function formatEngines(cluster: Pick<IClusterModel, 'engines_up' | 'size'>): string {
  return `${cluster.engines_up}/${cluster.size}`;
}

/** `2048` → `"2 MB"`, `1048576` → `"1 GB"`, `64` → `"64 kB"`. */
export function formatPageSize(pageKb: number): string {
  if (pageKb >= 1024 * 1024 && pageKb % (1024 * 1024) === 0) {
    return `${pageKb / (1024 * 1024)} GB`;
  }
  if (pageKb >= 1024 && pageKb % 1024 === 0) {
    return `${pageKb / 1024} MB`;
  }
  return `${pageKb} kB`;
}

/** `"500/512 × 2 MB"` (free/total pages × page size), or `"none"`. */
export function formatHugepages(hugepages: IHugepages | null): string {
  if (!hugepages || hugepages.total <= 0) {
    return 'none';
  }
  return `${hugepages.free}/${hugepages.total} × ${formatPageSize(hugepages.page_kb)}`;
}

/** `"74.2 samples/s"`, `"319 samples/s"`, `"12.5k samples/s"`; {@link NONE} when not measured yet. */
export function formatThroughput(samplesPerS: number | null | undefined): string {
  if (samplesPerS === null || samplesPerS === undefined || !Number.isFinite(samplesPerS) || samplesPerS < 0) {
    return NONE;
  }
  let value: string;
  if (samplesPerS >= 10000) {
    value = `${(samplesPerS / 1000).toFixed(1)}k`;
  } else if (samplesPerS >= 100) {
    value = `${Math.round(samplesPerS)}`;
  } else {
    value = samplesPerS.toFixed(1);
  }
  return `${value} samples/s`;
}

/** `"41/100"` when the run knows its total, else `"41"`. */
export function formatStep(run: Pick<IClusterRun, 'step' | 'total'>): string {
  return run.total === null ? `${run.step}` : `${run.step}/${run.total}`;
}

/**
 * A running cell's progress for the sidebar: `step 225/2400`, or `running` while its ranks count no step
 * (no `taco.progress` loop and no `DistributedOptimizer` step yet), never a `step 0` that would look stuck.
 */
export function formatProgress(run: Pick<IClusterRun, 'step' | 'total'>): string {
  return run.step === 0 && run.total === null ? 'running' : `step ${formatStep(run)}`;
}

/**
 * The first line of a cell that says what it does: magics (`%%taco_run …`), blank lines and comments are
 * skipped; cut to `maxLength` with an ellipsis.
 */
export function cellSnippet(cell: string, maxLength = 60): string {
  const lines = cell.split('\n').map(line => line.trim());
  const meaningful =
    lines.find(line => line && !line.startsWith('%') && !line.startsWith('#')) ?? lines.find(line => line) ?? '';
  if (meaningful.length <= maxLength) {
    return meaningful;
  }
  return `${meaningful.slice(0, Math.max(0, maxLength - 1))}…`;
}

/** The distinct hosts, in node order: `"n0, n1"`. */
export function formatHosts(nodes: IClusterNode[]): string {
  const hosts: string[] = [];
  for (const node of [...nodes].sort((a, b) => a.node - b.node)) {
    if (!hosts.includes(node.host)) {
      hosts.push(node.host);
    }
  }
  return hosts.join(', ');
}

/** `"1 node"`, `"2 nodes"`. */
export function formatNodeCount(count: number): string {
  return `${count} node${count === 1 ? '' : 's'}`;
}

/** `"45s"`, `"3m 12s"`, `"2h 05m"`: time since `startedAt` (seconds since the epoch). */
export function formatElapsed(startedAt: number, now: number): string {
  const seconds = Math.max(0, Math.floor(now - startedAt));
  if (seconds < 60) {
    return `${seconds}s`;
  }
  if (seconds < 3600) {
    return `${Math.floor(seconds / 60)}m ${String(seconds % 60).padStart(2, '0')}s`;
  }
  return `${Math.floor(seconds / 3600)}h ${String(Math.floor((seconds % 3600) / 60)).padStart(2, '0')}m`;
}

/** The text of the state badge: the state, or what is pending on it (`"stopping…"`, `"scaling to 8…"`). */
export function stateLabel(cluster: Pick<IClusterModel, 'state' | 'pending'>): string {
  const pending = cluster.pending;
  if (pending && cluster.state !== 'stale' && cluster.state !== 'stopped') {
    return pending.action === 'stop' ? 'stopping…' : `scaling to ${pending.size ?? '?'}…`;
  }
  return cluster.state;
}

/** The badge's tooltip: why a cluster is in its state. A stale one is explained by the server's `error`. */
export function stateDescription(cluster: Pick<IClusterModel, 'state' | 'owner' | 'error'>): string {
  const owner = `${cluster.owner.kind === 'kernel' ? 'kernel' : 'Jupyter server'} process ${cluster.owner.pid}`;
  switch (cluster.state) {
    case 'stale':
      return cluster.error ? `Stale: ${cluster.error}` : `Stale: its owner (${owner}) is gone.`;
    case 'broken':
      return `Broken${cluster.error ? `: ${cluster.error}` : ''}`;
    case 'starting':
      return `Starting (owned by ${owner})`;
    case 'stopping':
      return 'Stopping';
    case 'stopped':
      return 'Stopped';
    default:
      return `Running (owned by ${owner})`;
  }
}

const SHELL_SAFE = /^[A-Za-z0-9_.:@%+=,/-]+$/;

/** Quote a word for the magic's shell-like argument parser. */
export function shellQuote(word: string): string {
  if (SHELL_SAFE.test(word)) {
    return word;
  }
  return `'${word.replace(/'/g, `'"'"'`)}'`;
}

/** The first line of a cell that runs on `cluster`: `%%taco_run -np 4 --cluster default\n`. */
export function tacoRunHeader(cluster: Pick<IClusterModel, 'name' | 'size'>): string {
  return `%%taco_run -np ${cluster.size} --cluster ${shellQuote(cluster.name)}\n`;
}

/** The most engines one dialog may ask for when the server does not say (`GET version`'s `max_ranks`). */
export const MAX_CLUSTER_SIZE = 4096;

/** The dialogs' cap: the server's `max_ranks` when it is a positive integer, else {@link MAX_CLUSTER_SIZE}. */
export function sizeCap(maxRanks: number | null | undefined): number {
  return typeof maxRanks === 'number' && Number.isInteger(maxRanks) && maxRanks >= 1 ? maxRanks : MAX_CLUSTER_SIZE;
}

/** Parse the size typed into a dialog: a positive integer up to `max`, or a message that says what is wrong. */
export function parseSize(text: string, max = MAX_CLUSTER_SIZE): { size: number } | { error: string } {
  const trimmed = text.trim();
  if (!/^\d+$/.test(trimmed) || Number(trimmed) < 1) {
    return { error: `The number of engines must be a positive integer, got '${text}'` };
  }
  const size = Number(trimmed);
  if (size > max) {
    return {
      error:
        `The number of engines must be at most ${max}, got ${size}` +
        (max === MAX_CLUSTER_SIZE ? '' : ' (the server\'s limit: set TACO_MAX_RANKS where it runs to raise it)')
    };
  }
  return { size };
}

/** The last part of a path: `"work/train.ipynb"` → `"train.ipynb"`. */
export function baseName(path: string): string {
  const parts = path.split('/').filter(part => part);
  return parts.length ? parts[parts.length - 1] : path;
}

/**
 * What a card says besides the cluster's name: the notebook whose kernel owns it (`"train.ipynb"`), or
 * `"started here"` for a cluster the sidebar started, or the kernel's pid when the notebook is not known.
 */
export function ownerLabel(cluster: Pick<IClusterModel, 'owner'>): string {
  const owner = cluster.owner;
  if (owner.kind === 'server') {
    return 'started from the sidebar';
  }
  return owner.notebook ? baseName(owner.notebook) : `kernel ${owner.pid}`;
}

/** The owner label's tooltip: the notebook's full path and the processes behind it. */
export function ownerDescription(cluster: Pick<IClusterModel, 'owner'>): string {
  const owner = cluster.owner;
  const server = owner.server_pid ? ` of Jupyter server ${owner.server_pid}` : '';
  if (owner.kind === 'server') {
    return `Owned by Jupyter server process ${owner.pid}`;
  }
  return `${owner.notebook ? `${owner.notebook}: ` : ''}kernel process ${owner.pid}${server}`;
}

/** Clusters of the Jupyter server answering, and those of other servers (`this_server === false`). */
export function splitByServer<T extends Pick<IClusterModel, 'this_server'>>(
  clusters: readonly T[]
): { mine: T[]; others: T[] } {
  return {
    mine: clusters.filter(c => c.this_server !== false),
    others: clusters.filter(c => c.this_server === false)
  };
}

/**
 * One line per node that reports GPU model names: `"n0: 2 × NVIDIA H100"`, `"n1: A100, L4"`; empty when no node
 * reports them (the card then shows the GPU count alone).
 */
export function gpuNameLines(nodes: IClusterNode[]): string[] {
  const lines: string[] = [];
  for (const node of [...nodes].sort((a, b) => a.node - b.node)) {
    if (!node.gpu_names || node.gpu_names.length === 0) {
      continue;
    }
    const counts = new Map<string, number>();
    for (const name of node.gpu_names) {
      counts.set(name, (counts.get(name) ?? 0) + 1);
    }
    const models = [...counts].map(([name, count]) => (count > 1 ? `${count} × ${name}` : name));
    lines.push(`${node.host}: ${models.join(', ')}`);
  }
  return lines;
}

/** Whether scaling `cluster` to `size` removes engines (the sidebar asks before doing it). */
export function isScaleDown(cluster: Pick<IClusterModel, 'size'>, size: number): boolean {
  return size < cluster.size;
}

/** The confirm dialog's text before a stop: what is lost, and the run it ends if one is going on. */
export function stopConfirmation(cluster: Pick<IClusterModel, 'name' | 'state' | 'run'>): {
  title: string;
  body: string;
  label: string;
} {
  if (cluster.state === 'stale') {
    return {
      title: `Remove stale cluster ${cluster.name}?`,
      body: 'Its kernel is gone. The entry is removed, and any engine process it left running is ended.',
      label: 'Remove'
    };
  }
  const run = cluster.run
    ? ` It is running a cell (${cellSnippet(cluster.run.cell)}): that run ends on every rank.`
    : '';
  return {
    title: `Stop cluster ${cluster.name}?`,
    body: `Its engines stop and their variables are lost.${run}`,
    label: 'Stop'
  };
}

/** The confirm dialog's text before scaling down. */
export function scaleDownConfirmation(cluster: Pick<IClusterModel, 'name' | 'size'>, size: number): string {
  return (
    `Cluster ${cluster.name} restarts with ${size} engine${size === 1 ? '' : 's'} instead of ${cluster.size}: ` +
    "an MPI job's size is fixed at launch, so every engine's variables are lost."
  );
}

/**
 * An elastic cluster's membership in one line: `"elastic 2:4 · lost rank 2 (n1, SIGKILL) · 1 joined ·
 * blacklisted n1"`; `null` for a cluster that never ran an elastic cell.
 */
export function formatMembership(membership: IMembership | null): string | null {
  if (!membership) {
    return null;
  }
  const parts = [`elastic ${membership.min}:${membership.max}`];
  if (membership.lost.length) {
    const lost = membership.lost.map(l => `${l.rank} (${l.host}, ${l.how})`).join(', ');
    parts.push(`lost rank${membership.lost.length > 1 ? 's' : ''} ${lost}`);
  }
  if (membership.joined) {
    parts.push(`${membership.joined} joined`);
  }
  if (membership.blacklisted.length) {
    parts.push(`blacklisted ${membership.blacklisted.join(', ')}`);
  }
  return parts.join(' · ');
}
