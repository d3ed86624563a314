import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import {
  baseName,
  gpuNameLines,
  isScaleDown,
  MAX_CLUSTER_SIZE,
  ownerDescription,
  ownerLabel,
  parseSize,
  scaleDownConfirmation,
  sizeCap,
  splitByServer,
  stateDescription,
  stopConfirmation
} from '../format';
import { parseCluster } from '../models';
import { clusterJson } from './fixtures';

describe('cards named by cluster and notebook', () => {
  it("shows the owning notebook's file name, its path and pids in the title", () => {
    const cluster = parseCluster(
      clusterJson({ owner: { kind: 'kernel', pid: 4242, notebook: 'work/exp/train.ipynb', server_pid: 77 } })
    );
    assert.equal(ownerLabel(cluster), 'train.ipynb');
    assert.equal(ownerDescription(cluster), 'work/exp/train.ipynb: kernel process 4242 of Jupyter server 77');
  });

  it('falls back to the kernel pid, and names sidebar-started clusters', () => {
    const unnamed = { kind: 'kernel', pid: 4242, notebook: null, server_pid: null };
    assert.equal(ownerLabel(parseCluster(clusterJson({ owner: unnamed }))), 'kernel 4242');
    assert.equal(ownerLabel({ owner: { kind: 'kernel', pid: 5, notebook: null, server_pid: null } }), 'kernel 5');
    assert.equal(ownerLabel({ owner: { kind: 'server', pid: 9, notebook: null, server_pid: 9 } }), 'started from the sidebar');
    assert.equal(ownerDescription({ owner: { kind: 'server', pid: 9, notebook: null, server_pid: 9 } }), 'Owned by Jupyter server process 9');
    assert.equal(baseName('a.ipynb'), 'a.ipynb');
    assert.equal(baseName('dir/sub/'), 'sub');
  });
});

describe('clusters of other Jupyter servers', () => {
  it('are set apart', () => {
    const mine = parseCluster(clusterJson({ id: 'a', this_server: true }));
    const legacy = parseCluster(clusterJson({ id: 'b' }));
    const other = parseCluster(clusterJson({ id: 'c', this_server: false }));
    const split = splitByServer([mine, other, legacy]);
    assert.deepEqual(
      split.mine.map(c => c.id),
      ['a', 'b']
    );
    assert.deepEqual(
      split.others.map(c => c.id),
      ['c']
    );
  });
});

describe('stale cards', () => {
  it("are explained with the server's sentence, never with a wording of our own about killing", () => {
    const error = 'its kernel (pid 99) exited; none of its engines is running';
    const text = stateDescription({ state: 'stale', owner: { kind: 'kernel', pid: 99, notebook: null, server_pid: null }, error });
    assert.equal(text, `Stale: ${error}`);
    assert.doesNotMatch(text, /delete the entry/);
    const confirm = stopConfirmation({ name: 'default', state: 'stale', run: null });
    assert.equal(confirm.label, 'Remove');
    assert.doesNotMatch(confirm.body, /delete the entry to kill/);
  });
});

describe('confirmations', () => {
  it('a stop says what is lost, and names the run it ends', () => {
    const idle = stopConfirmation({ name: 'default', state: 'running', run: null });
    assert.equal(idle.title, 'Stop cluster default?');
    assert.match(idle.body, /variables are lost/);
    const busy = stopConfirmation(parseCluster(clusterJson()));
    assert.match(busy.body, /running a cell \(model\.train\(\)\)/);
  });

  it('only a smaller size asks before scaling', () => {
    assert.equal(isScaleDown({ size: 4 }, 2), true);
    assert.equal(isScaleDown({ size: 4 }, 4), false);
    assert.equal(isScaleDown({ size: 4 }, 8), false);
    assert.equal(
      scaleDownConfirmation({ name: 'default', size: 4 }, 1),
      "Cluster default restarts with 1 engine instead of 4: an MPI job's size is fixed at launch, so every " +
        "engine's variables are lost."
    );
  });
});

describe("the size dialog's cap", () => {
  it("is the server's max_ranks when it sends one", () => {
    assert.equal(sizeCap(8), 8);
    assert.equal(sizeCap(null), MAX_CLUSTER_SIZE);
    assert.equal(sizeCap(undefined), 4096);
    assert.equal(sizeCap(0), 4096);
    assert.equal(sizeCap(2.5), 4096);
    assert.deepEqual(parseSize('8', 8), { size: 8 });
    assert.match((parseSize('9', 8) as { error: string }).error, /at most 8, got 9 .*TACO_MAX_RANKS/);
  });
});

describe('GPU names per node', () => {
  it('lists each node that reports them, identical models counted', () => {
    const cluster = parseCluster(
      clusterJson({
        nodes: [
          { node: 1, host: 'n1', ranks: [2, 3], gpus: 2, gpu_names: ['A100', 'L4'] },
          { node: 0, host: 'n0', ranks: [0, 1], gpus: 2, gpu_names: ['NVIDIA H100', 'NVIDIA H100'] }
        ]
      })
    );
    assert.deepEqual(gpuNameLines(cluster.nodes), ['n0: 2 × NVIDIA H100', 'n1: A100, L4']);
    assert.deepEqual(gpuNameLines(parseCluster(clusterJson()).nodes), []);
  });
});
