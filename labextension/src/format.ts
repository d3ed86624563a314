/**
 * What the sidebar shows for a cluster, as plain strings.
 *
 * Pure: no JupyterLab import, so the unit tests run in plain Node.
 */

import type { IClusterModel, IClusterNode, IClusterRun, IHugepages } from './models';

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

/** The badge's tooltip: why a cluster is in its state. */
export function stateDescription(cluster: Pick<IClusterModel, 'state' | 'owner' | 'error'>): string {
  const owner = `${cluster.owner.kind === 'kernel' ? 'kernel' : 'Jupyter server'} process ${cluster.owner.pid}`;
  switch (cluster.state) {
    case 'stale':
      return `Stale: its owner (${owner}) is gone, so nothing manages these engines. Stop it to clean up.`;
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

/** The most engines one dialog may ask for; the server has the final word. */
export const MAX_CLUSTER_SIZE = 4096;

/** Parse the size typed into a dialog: a positive integer, or a message that says what is wrong. */
export function parseSize(text: string): { size: number } | { error: string } {
  const trimmed = text.trim();
  if (!/^\d+$/.test(trimmed) || Number(trimmed) < 1) {
    return { error: `The number of engines must be a positive integer, got '${text}'` };
  }
  const size = Number(trimmed);
  if (size > MAX_CLUSTER_SIZE) {
    return { error: `The number of engines must be at most ${MAX_CLUSTER_SIZE}, got ${size}` };
  }
  return { size };
}
