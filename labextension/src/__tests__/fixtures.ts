/** A valid `ClusterModel` as the server extension sends it, for the tests to vary. */
export function clusterJson(overrides: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    id: 'c0ffee',
    name: 'default',
    profile: 'taco-default',
    owner: { kind: 'kernel', pid: 4242, notebook: 'work/train.ipynb', server_pid: 4000 },
    this_server: true,
    state: 'running',
    size: 4,
    engines_up: 3,
    mpi: 'mpich 5.0.2',
    nodes: [
      { node: 1, host: 'n1', ranks: [2, 3], gpus: 0, gpu_names: [] },
      { node: 0, host: 'n0', ranks: [0, 1], gpus: 0, gpu_names: [] }
    ],
    gpus: 0,
    hugepages: { total: 512, free: 500, page_kb: 2048 },
    started_at: 1700000000.5,
    updated_at: 1700000042.25,
    run: { cell: '%%taco_run -np 4\nmodel.train()\n', started_at: 1700000010, step: 41, total: 100, samples_per_s: 74.2 },
    pending: null,
    error: null,
    membership: null,
    ...overrides
  };
}
