import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { InvalidResponseError, parseCluster } from '../models';
import { clusterJson } from './fixtures';

describe('node GPU models', () => {
  it('keeps the GPU models of each node', () => {
    const h100 = 'NVIDIA H100 80GB HBM3';
    const nodes = [{ node: 0, host: 'g0', ranks: [0, 1], gpus: 2, gpu_names: [h100, h100] }];
    const cluster = parseCluster(clusterJson({ nodes, gpus: 2 }));
    assert.deepEqual(cluster.nodes[0].gpu_names, [h100, h100]);
  });

  it('reads a node from a server that predates gpu_names as having none', () => {
    const cluster = parseCluster(clusterJson({ nodes: [{ node: 0, host: 'n0', ranks: [0], gpus: 0 }] }));
    assert.deepEqual(cluster.nodes[0].gpu_names, []);
  });

  it('rejects GPU models that are not strings, naming the field', () => {
    const nodes = [{ node: 0, host: 'n0', ranks: [0], gpus: 1, gpu_names: [7] }];
    assert.throws(() => parseCluster(clusterJson({ nodes })), (e: unknown) =>
      e instanceof InvalidResponseError && /nodes\[0\]\.gpu_names/.test(String(e)));
  });
});
