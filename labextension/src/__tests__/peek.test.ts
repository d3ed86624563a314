import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { ServerConnection } from '@jupyterlab/services';

import { InvalidResponseError, parsePeek } from '../models';
import { ApiError, ClusterAPI } from '../request';

/** A peek answer as the server sends it: one rank with a value, one whose expression raised, one silent. */
function peekJson(overrides: Record<string, unknown> = {}): Record<string, unknown> {
  return {
    expression: 'count > 0',
    seconds: 0.0123,
    text: 'count > 0 on 3 ranks, read in 0.01 s\nrank 0: True\nrank 1: NameError: count\nrank 2: no answer: gone',
    ranks: [
      { rank: 0, value: 'True' },
      { rank: 1, error: 'NameError: count' },
      { rank: 2, missing: 'gone' }
    ],
    ...overrides
  };
}

interface ISent {
  url: string;
  method: string;
  body: unknown;
}

/** A client whose server records what was sent and replies with `status` and `body`. */
function apiAnswering(status: number, body: unknown): { api: ClusterAPI; sent: ISent[] } {
  const sent: ISent[] = [];
  const fetch = async (input: RequestInfo | URL, init?: RequestInit): Promise<Response> => {
    const request = new Request(input, init);
    const text = await request.text();
    const url = new URL(request.url);
    // ServerConnection appends a cache-busting `?<time>` to every URL: compare the path.
    sent.push({ url: url.origin + url.pathname, method: request.method, body: text ? JSON.parse(text) : null });
    return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } });
  };
  const settings = ServerConnection.makeSettings({ baseUrl: 'http://lab.test/base/', fetch });
  return { api: new ClusterAPI(settings), sent };
}

describe('parsePeek', () => {
  it("keeps every field and each rank's kind of answer", () => {
    const json = peekJson();
    assert.deepEqual(parsePeek(json), json);
  });

  it('names the first bad field', () => {
    assert.throws(() => parsePeek(peekJson({ text: 3 })), {
      name: 'InvalidResponseError',
      message: 'peek.text: expected a string, got number'
    });
    assert.throws(() => parsePeek(peekJson({ seconds: '0.1' })), /peek\.seconds: expected a number/);
    assert.throws(() => parsePeek(peekJson({ ranks: {} })), /peek\.ranks: expected an array, got object/);
    assert.throws(() => parsePeek(peekJson({ ranks: [{ rank: '0', value: 'x' }] })), /peek\.ranks\[0\]\.rank/);
    const answer = (rank: Record<string, unknown>) => peekJson({ ranks: [rank] });
    assert.throws(() => parsePeek(answer({ rank: 0, value: 1 })), /peek\.ranks\[0\]\.value: expected a string/);
    assert.throws(() => parsePeek(answer({ rank: 0 })), /peek\.ranks\[0\]: expected one of value\|error\|missing/);
  });

  it('rejects what is not an object', () => {
    assert.throws(() => parsePeek(null), InvalidResponseError);
    assert.throws(() => parsePeek([]), /peek: expected an object, got array/);
  });
});

describe('ClusterAPI.peek', () => {
  it('POSTs the expression as JSON to the cluster, ranks and timeout only when given', async () => {
    const { api, sent } = apiAnswering(200, peekJson());
    const result = await api.peek('c0 ffee', 'count > 0');
    assert.equal(result.text, peekJson().text);
    await api.peek('c0ffee', 'loss.item()', [0, 2], 2.5);
    assert.deepEqual(sent, [
      {
        url: 'http://lab.test/base/taco-notebook/api/clusters/c0%20ffee/peek',
        method: 'POST',
        body: { expr: 'count > 0' }
      },
      {
        url: 'http://lab.test/base/taco-notebook/api/clusters/c0ffee/peek',
        method: 'POST',
        body: { expr: 'loss.item()', ranks: [0, 2], timeout: 2.5 }
      }
    ]);
  });

  it("turns the server's 400, 403 and 409 into an ApiError with its message", async () => {
    for (const [status, message] of [
      [400, "field 'expr' is required: a Python expression, e.g. \"loss.item()\", got ''"],
      [403, 'Forbidden: no execute permission on kernels'],
      [409, 'cluster c0ffee is stopped: it has no ranks to peek into']
    ] as const) {
      const { api } = apiAnswering(status, { message, reason: '' });
      await assert.rejects(api.peek('c0ffee', ' '), (error: unknown) => {
        assert.ok(error instanceof ApiError);
        assert.equal(error.status, status);
        assert.equal(error.message, message);
        return true;
      });
    }
  });

  it('refuses a malformed answer, naming the field', async () => {
    const { api } = apiAnswering(200, peekJson({ ranks: [{ rank: 0 }] }));
    await assert.rejects(api.peek('c0ffee', 'step'), {
      name: 'ApiError',
      message: /^Unexpected response from clusters\/c0ffee\/peek: peek\.ranks\[0\]: expected one of/
    });
  });
});
