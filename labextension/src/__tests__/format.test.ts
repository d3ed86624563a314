import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import {
  cellSnippet,
  formatElapsed,
  formatEngines,
  formatHosts,
  formatHugepages,
  formatMembership,
  formatNodeCount,
  formatPageSize,
  formatProgress,
  formatStep,
  formatThroughput,
  NONE,
  parseSize,
  shellQuote,
  stateDescription,
  stateLabel,
  tacoRunHeader
} from '../format';
import { parseCluster } from '../models';
import { clusterJson } from './fixtures';

describe('formatting a cluster', () => {
  const cluster = parseCluster(clusterJson());

  it('shows engines as up/size', () => {
    assert.equal(formatEngines(cluster), '3/4');
    assert.equal(formatEngines({ engines_up: 0, size: 16 }), '0/16');
  });

  it('shows hugepages as free/total × page size, or none', () => {
    assert.equal(formatHugepages(cluster.hugepages), '500/512 × 2 MB');
    assert.equal(formatHugepages({ total: 4, free: 0, page_kb: 1048576 }), '0/4 × 1 GB');
    assert.equal(formatHugepages(null), 'none');
    assert.equal(formatHugepages({ total: 0, free: 0, page_kb: 2048 }), 'none');
    assert.equal(formatPageSize(64), '64 kB');
    assert.equal(formatPageSize(1536), '1536 kB');
  });

  it('shows throughput with sensible precision', () => {
    assert.equal(formatThroughput(74.24), '74.2 samples/s');
    assert.equal(formatThroughput(319.4), '319 samples/s');
    assert.equal(formatThroughput(12500), '12.5k samples/s');
    assert.equal(formatThroughput(0), '0.0 samples/s');
    assert.equal(formatThroughput(null), NONE);
    assert.equal(formatThroughput(Number.NaN), NONE);
  });

  it('shows the step with its total when known', () => {
    assert.equal(formatStep({ step: 41, total: 100 }), '41/100');
    assert.equal(formatStep({ step: 7, total: null }), '7');
  });

  it('says running, not a stuck-looking step 0, while the ranks count no step', () => {
    assert.equal(formatProgress({ step: 0, total: null }), 'running');
    assert.equal(formatProgress({ step: 0, total: 2400 }), 'step 0/2400');
    assert.equal(formatProgress({ step: 225, total: 2400 }), 'step 225/2400');
  });

  it('lists hosts once each, in node order', () => {
    assert.equal(formatHosts(cluster.nodes), 'n0, n1');
    assert.equal(
      formatHosts([
        { node: 0, host: 'vm', ranks: [0], gpus: 0, gpu_names: [] },
        { node: 1, host: 'vm', ranks: [1], gpus: 0, gpu_names: [] }
      ]),
      'vm'
    );
    assert.equal(formatNodeCount(1), '1 node');
    assert.equal(formatNodeCount(2), '2 nodes');
  });

  it('formats elapsed time', () => {
    assert.equal(formatElapsed(100, 145.9), '45s');
    assert.equal(formatElapsed(0, 192), '3m 12s');
    assert.equal(formatElapsed(0, 7500), '2h 05m');
    assert.equal(formatElapsed(10, 5), '0s');
  });
});

describe('cellSnippet', () => {
  it('skips magics, comments and blank lines', () => {
    assert.equal(cellSnippet('%%taco_run -np 4\n\n# train\nfor x in data:\n  step(x)'), 'for x in data:');
  });

  it('cuts long lines with an ellipsis', () => {
    const snippet = cellSnippet('x = ' + 'a'.repeat(100), 20);
    assert.equal(snippet.length, 20);
    assert.ok(snippet.endsWith('…'));
  });

  it('falls back to the magic line, or empty', () => {
    assert.equal(cellSnippet('%%taco_run -np 2\n'), '%%taco_run -np 2');
    assert.equal(cellSnippet(''), '');
  });
});

describe('state badge', () => {
  it('shows the state, or what is pending', () => {
    assert.equal(stateLabel({ state: 'running', pending: null }), 'running');
    assert.equal(stateLabel({ state: 'running', pending: { action: 'stop', size: null, requested_at: 1 } }), 'stopping…');
    assert.equal(stateLabel({ state: 'running', pending: { action: 'scale', size: 8, requested_at: 1 } }), 'scaling to 8…');
    assert.equal(stateLabel({ state: 'stale', pending: { action: 'stop', size: null, requested_at: 1 } }), 'stale');
  });

  it('explains stale and broken clusters', () => {
    assert.match(
      stateDescription({ state: 'stale', owner: { kind: 'kernel', pid: 99, notebook: null, server_pid: null }, error: null }),
      /^Stale: its owner \(kernel process 99\) is gone/
    );
    assert.equal(stateDescription({ state: 'broken', owner: { kind: 'server', pid: 1, notebook: null, server_pid: 1 }, error: 'rank 3 died' }), 'Broken: rank 3 died');
  });
});

describe('the %%taco_run cell', () => {
  it('names the size and the cluster', () => {
    assert.equal(tacoRunHeader({ name: 'default', size: 4 }), '%%taco_run -np 4 --cluster default\n');
  });

  it('quotes names the magic would split', () => {
    assert.equal(shellQuote('gpu-2x4'), 'gpu-2x4');
    assert.equal(shellQuote('my cluster'), "'my cluster'");
    assert.equal(shellQuote("it's"), `'it'"'"'s'`);
    assert.equal(tacoRunHeader({ name: 'a b', size: 2 }), "%%taco_run -np 2 --cluster 'a b'\n");
  });
});

describe('parseSize', () => {
  it('accepts positive integers', () => {
    assert.deepEqual(parseSize('4'), { size: 4 });
    assert.deepEqual(parseSize(' 16 '), { size: 16 });
  });

  it('says what is wrong otherwise', () => {
    assert.deepEqual(parseSize('abc'), { error: "The number of engines must be a positive integer, got 'abc'" });
    assert.ok('error' in parseSize('0'));
    assert.ok('error' in parseSize('-2'));
    assert.ok('error' in parseSize('2.5'));
    assert.ok('error' in parseSize(''));
    assert.match((parseSize('100000') as { error: string }).error, /at most 4096/);
  });
});

describe('an elastic cluster\'s membership', () => {
  it('is absent until an elastic cell ran, then lists lost ranks, joins and blacklisted hosts', () => {
    assert.equal(formatMembership(parseCluster(clusterJson()).membership), null);
    const membership = {
      min: 2,
      max: 4,
      lost: [{ rank: 2, host: 'n1', how: 'SIGKILL', at: 1700000020 }],
      joined: 1,
      blacklisted: ['n1']
    };
    assert.equal(
      formatMembership(parseCluster(clusterJson({ membership })).membership),
      'elastic 2:4 · lost rank 2 (n1, SIGKILL) · 1 joined · blacklisted n1'
    );
    assert.throws(
      () => parseCluster(clusterJson({ membership: { ...membership, lost: [{ rank: 'x' }] } })),
      /cluster\.membership\.lost\[0\]\.rank: expected a number/
    );
  });
});
