import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { errorMessage, InvalidResponseError, parseCluster, parseClusterList, parseVersion } from '../models';
import { clusterJson } from './fixtures';

describe('parseCluster', () => {
  it('keeps every field of a valid cluster', () => {
    const json = clusterJson();
    assert.deepEqual(parseCluster(json), json);
  });

  it('accepts the nullable fields as null', () => {
    const json = clusterJson({ hugepages: null, started_at: null, run: null, pending: null, error: null });
    const cluster = parseCluster(json);
    assert.equal(cluster.hugepages, null);
    assert.equal(cluster.run, null);
    assert.equal(cluster.started_at, null);
  });

  it('accepts a run without total or throughput, and a pending scale', () => {
    const cluster = parseCluster(
      clusterJson({
        run: { cell: 'x', started_at: 1, step: 0, total: null, samples_per_s: null },
        pending: { action: 'scale', size: 8, requested_at: 2 }
      })
    );
    assert.equal(cluster.run?.total, null);
    assert.deepEqual(cluster.pending, { action: 'scale', size: 8, requested_at: 2 });
  });

  it('drops fields the model does not know', () => {
    const cluster = parseCluster(clusterJson({ extra: 1 }));
    assert.equal('extra' in cluster, false);
  });

  it('names the first bad field', () => {
    assert.throws(() => parseCluster(clusterJson({ size: '4' })), {
      name: 'InvalidResponseError',
      message: 'cluster.size: expected a number, got string'
    });
    assert.throws(() => parseCluster(clusterJson({ state: 'exploded' })), /cluster\.state: expected one of starting\|/);
    assert.throws(() => parseCluster(clusterJson({ owner: { kind: 'robot', pid: 1 } })), /cluster\.owner\.kind/);
    assert.throws(() => parseCluster(clusterJson({ this_server: 'yes' })), /cluster\.this_server: expected a boolean/);
    assert.throws(
      () => parseCluster(clusterJson({ owner: { kind: 'kernel', pid: 1, notebook: 3, server_pid: null } })),
      /cluster\.owner\.notebook/
    );
    const unknown = parseCluster(clusterJson({ owner: { kind: 'kernel', pid: 1, notebook: null, server_pid: null } }));
    assert.deepEqual(unknown.owner, { kind: 'kernel', pid: 1, notebook: null, server_pid: null });
    assert.throws(
      () => parseCluster(clusterJson({ nodes: [{ node: 0, host: 'n0', ranks: ['0'], gpus: 0 }] })),
      /cluster\.nodes\[0\]\.ranks: expected an array of numbers/
    );
    assert.throws(() => parseCluster(clusterJson({ run: { cell: 1 } })), /cluster\.run\.cell: expected a string, got number/);
    assert.throws(() => parseCluster(clusterJson({ updated_at: Number.NaN })), /cluster\.updated_at/);
  });

  it('rejects what is not an object', () => {
    assert.throws(() => parseCluster(null), InvalidResponseError);
    assert.throws(() => parseCluster([]), /expected an object, got array/);
  });
});

describe('parseClusterList', () => {
  it('parses each cluster and says which one is bad', () => {
    assert.equal(parseClusterList({ clusters: [clusterJson(), clusterJson({ id: 'b' })] }).clusters.length, 2);
    assert.deepEqual(parseClusterList({ clusters: [] }), { clusters: [] });
    assert.throws(() => parseClusterList({ clusters: [clusterJson(), { id: 1 }] }), /clusters\[1\]\.id/);
    assert.throws(() => parseClusterList({}), /response\.clusters: expected an array, got undefined/);
  });
});

describe('parseVersion', () => {
  it('wants a string version', () => {
    assert.deepEqual(parseVersion({ version: '0.1.0', max_ranks: 8 }), { version: '0.1.0', max_ranks: 8 });
    assert.throws(() => parseVersion({ version: 1, max_ranks: 8 }), /response\.version/);
    assert.throws(() => parseVersion({ version: '0.1.0' }), /response\.max_ranks/);
  });

  it('checks max_ranks', () => {
    assert.throws(() => parseVersion({ version: '0.1.0', max_ranks: '8' }), /response\.max_ranks/);
  });
});

describe('the owner, server and GPU fields', () => {
  it('are kept and checked', () => {
    const owner = { kind: 'kernel', pid: 1, notebook: 'a/b.ipynb', server_pid: 2 };
    const nodes = [{ node: 0, host: 'n0', ranks: [0], gpus: 1, gpu_names: ['H100'] }];
    const json = clusterJson({ owner, this_server: false, nodes });
    assert.deepEqual(parseCluster(json), json);
    assert.equal(parseCluster(clusterJson({ owner: { ...owner, notebook: null } })).owner.notebook, null);
    assert.throws(() => parseCluster(clusterJson({ this_server: 'yes' })), /cluster\.this_server: expected a boolean/);
    assert.throws(() => parseCluster(clusterJson({ this_server: undefined })), /cluster\.this_server/);
    assert.throws(
      () => parseCluster(clusterJson({ nodes: [{ ...nodes[0], gpu_names: [1] }] })),
      /cluster\.nodes\[0\]\.gpu_names: expected an array of strings/
    );
  });
});

describe('errorMessage', () => {
  it("prefers the server's message", () => {
    assert.equal(errorMessage(400, 'Bad Request', { message: 'size must be positive', reason: 'bad' }), 'size must be positive');
  });

  it('falls back to plain text, then to the status', () => {
    assert.equal(errorMessage(500, 'Internal Server Error', 'boom'), 'boom');
    assert.equal(errorMessage(502, 'Bad Gateway', '<html>proxy</html>'), 'HTTP 502 Bad Gateway');
    assert.equal(errorMessage(404, '', null), 'HTTP 404');
    assert.equal(errorMessage(500, 'Internal Server Error', { message: '  ' }), 'HTTP 500 Internal Server Error');
  });
});
