/**
 * The cursor-rest hint (rest.ts) with a clock the test moves: one notification once the cursor has rested,
 * at the last place; none again at the same place, none while suggestions are off, none after dispose.
 * The server side is tested in tests/test_prefetch.py.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { CURSOR_REST_METHOD, CursorPlace, CursorRest, REST_MS, RestParams } from '../rest';
import { FakeClock } from './fakes';

function place(line: number, character: number, version = 1, languageId = 'python'): CursorPlace {
  return { uri: 'file:///w/a.py', languageId, version, line, character };
}

test('a rest is sent once, where the cursor stopped, after REST_MS', () => {
  const clock = new FakeClock();
  const sent: RestParams[] = [];
  let on = true;
  const rest = new CursorRest((p) => sent.push(p), () => on, clock);
  assert.equal(CURSOR_REST_METHOD, 'completiond/cursorRest');
  rest.moved(place(3, 4));
  clock.advance(REST_MS - 1);
  rest.moved(place(40, 2)); // moved on before it rested
  clock.advance(REST_MS - 1);
  assert.deepEqual(sent, []);
  clock.advance(1);
  assert.deepEqual(sent, [{ textDocument: { uri: 'file:///w/a.py' }, position: { line: 40, character: 2 } }]);
  rest.moved(place(40, 2)); // the same place: nothing new to warm
  clock.advance(REST_MS);
  assert.equal(sent.length, 1);
  rest.moved(place(40, 2, 2)); // the same place in an edited document: warmed anew
  clock.advance(REST_MS);
  assert.equal(sent.length, 2);
  on = false; // snoozed, or the language turned off
  rest.moved(place(7, 0));
  clock.advance(REST_MS);
  assert.equal(sent.length, 2);
  on = true;
  rest.moved(place(8, 0));
  rest.moved(undefined); // no text editor active any more: nothing pending
  clock.advance(REST_MS);
  assert.equal(sent.length, 2);
  rest.moved(place(9, 1));
  rest.dispose();
  clock.advance(REST_MS);
  assert.equal(sent.length, 2);
  assert.equal(clock.pending, 0);
});

test('the language decides: a language with suggestions off gets no hint', () => {
  const clock = new FakeClock();
  const sent: RestParams[] = [];
  const rest = new CursorRest((p) => sent.push(p), (languageId) => languageId !== 'markdown', clock);
  rest.moved(place(1, 0, 1, 'markdown'));
  clock.advance(REST_MS);
  rest.moved(place(1, 0, 1, 'python'));
  clock.advance(REST_MS);
  assert.equal(sent.length, 1);
});
