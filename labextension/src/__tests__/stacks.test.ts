import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { InvalidResponseError, parseStacksText } from '../models';

describe('parseStacksText', () => {
  it('takes the report text of a stacks answer', () => {
    const text = 'stacks of 2 ranks, read in 0.01 s\nrank 0: allreduce #3 (waited 1.2 s) at train.py:41\n';
    assert.equal(parseStacksText({ text, suspects: [1], ranks: [] }), text);
  });

  it('refuses an answer without a text, naming the field', () => {
    assert.throws(() => parseStacksText({ suspects: [] }), InvalidResponseError);
    assert.throws(() => parseStacksText(null), /stacks\.text: expected a string, got undefined/);
  });
});
