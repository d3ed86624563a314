import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import {
  backoffDelay,
  failureKind,
  FailureLatch,
  LIVE_POLL_INTERVAL_MS,
  MAX_POLL_INTERVAL_MS,
  pollInterval,
  POLL_INTERVAL_MS
} from '../poll';

describe('backoffDelay', () => {
  it('polls every 2 s while all is well', () => {
    assert.equal(POLL_INTERVAL_MS, 2000);
    assert.equal(backoffDelay(0), 2000);
  });

  it('doubles per consecutive failure, up to 30 s', () => {
    assert.deepEqual([1, 2, 3, 4, 5, 100].map(n => backoffDelay(n)), [4000, 8000, 16000, 30000, 30000, 30000]);
    assert.equal(MAX_POLL_INTERVAL_MS, 30000);
  });

  it('takes its own base, cap and growth', () => {
    assert.equal(backoffDelay(2, 100, 1000, 3), 900);
    assert.equal(backoffDelay(10_000, 100, 1000, 3), 1000);
    assert.equal(backoffDelay(-1, 100), 100);
  });
});

describe('pollInterval', () => {
  it('polls every 0.5 s while a cell runs, so the step trails the cell by under a second', () => {
    assert.equal(pollInterval([{ run: null }, { run: { step: 3 } }]), LIVE_POLL_INTERVAL_MS);
    assert.ok(LIVE_POLL_INTERVAL_MS <= 500);
  });

  it('rests at 2 s when nothing runs', () => {
    assert.equal(pollInterval([{ run: null }]), POLL_INTERVAL_MS);
    assert.equal(pollInterval([]), POLL_INTERVAL_MS);
  });
});

describe('failureKind', () => {
  it('classifies by status', () => {
    assert.equal(failureKind(null), 'network');
    assert.equal(failureKind(0), 'network');
    assert.equal(failureKind(404), 'not-found');
    assert.equal(failureKind(403), 'forbidden');
    assert.equal(failureKind(409), 'client');
    assert.equal(failureKind(500), 'server');
    assert.equal(failureKind(200, true), 'invalid-response');
  });
});

describe('FailureLatch', () => {
  it('reports each kind once until cleared', () => {
    const latch = new FailureLatch();
    assert.equal(latch.report('server'), true);
    assert.equal(latch.report('server'), false);
    assert.equal(latch.report('network'), true);
    assert.deepEqual(latch.kinds, ['server', 'network']);
    latch.clear();
    assert.equal(latch.report('server'), true);
  });
});
