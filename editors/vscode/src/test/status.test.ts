import assert from 'node:assert/strict';
import { test } from 'node:test';
import { formatLatency, formatStats, metrics, statusView, suggestionCounts, suggestionSummary } from '../status';

test('ready shows the last latency and speed; the tooltip calls draft acceptance what it is', () => {
  const v = statusView({ state: 'ready', latencyMs: 123.4, draftAcceptance: 0.7251, tokensPerSecond: 41.6 }, undefined, true);
  assert.equal(v.text, '$(sparkle) completiond 123 ms · 42 tok/s');
  assert.match(v.tooltip, /draft tokens kept \(speculative decoding\): 73%/);
  assert.doesNotMatch(v.tooltip, /α|acceptance/);
  assert.equal(v.error, false);
  assert.match(v.tooltip, /ready/);
  assert.match(v.tooltip, /Click for the menu/);
});

test('the tooltip names the draft in use and what the last completion drafted with', () => {
  const v = statusView({ state: 'ready', draft: 'prompt lookup, else early exit at layer 5 of 10, K<=1',
    lastDraft: 'early_exit+prompt_lookup' }, undefined, true);
  assert.match(v.tooltip, /draft: prompt lookup, else early exit at layer 5 of 10, K<=1 \(last completion: early_exit\+prompt_lookup\)/);
  assert.doesNotMatch(statusView({ state: 'ready' }, undefined, true).tooltip, /draft:/);
});

test('ready before any completion shows no metrics', () => {
  assert.equal(statusView({ state: 'ready' }, undefined, true).text, '$(sparkle) completiond');
  assert.equal(statusView({ state: 'ready', latencyMs: null, alpha: null }, undefined, true).text, '$(sparkle) completiond');
});

test('loading shows the percentage and phase of the progress object the server sends', () => {
  // lsp/server.py send_status: progress is {phase, percentage (0-100), message} while loading.
  const v = statusView({ state: 'loading', progress: { phase: 'weights', percentage: 37, message: 'loading the weights' } }, undefined, true);
  assert.equal(v.text, '$(loading~spin) completiond 37%');
  assert.match(v.tooltip, /loading the model 37%…\nloading the weights/);
  const download = statusView({ state: 'loading', progress: { phase: 'download', percentage: 12, message: 'downloading x: 3 of 30 MB' } }, undefined, true);
  assert.equal(download.text, '$(loading~spin) completiond 12%');
  assert.match(download.tooltip, /downloading x: 3 of 30 MB/);
  assert.equal(statusView({ state: 'loading', progress: { phase: 'tokenizer' } }, undefined, true).text, '$(loading~spin) completiond');
  assert.equal(statusView({ state: 'loading', progress: { percentage: 250 } }, undefined, true).text, '$(loading~spin) completiond 100%');
  assert.equal(statusView({ state: 'loading', progress: null }, undefined, true).text, '$(loading~spin) completiond');
});

test('loading shows progress and the message (a fraction, as older servers sent it)', () => {
  const v = statusView({ state: 'loading', progress: 0.456, message: 'reading weights' }, undefined, true);
  assert.equal(v.text, '$(loading~spin) completiond 46%');
  assert.match(v.tooltip, /reading weights/);
  assert.equal(statusView({ state: 'loading' }, undefined, true).text, '$(loading~spin) completiond');
  assert.equal(statusView({ state: 'starting' }, undefined, true).text, '$(loading~spin) completiond');
});

test('the tooltip names the model and device', () => {
  const v = statusView({ state: 'ready', model: 'mini', device: 'cpu', latencyMs: 5 }, undefined, true);
  assert.match(v.tooltip, /model: mini on cpu/);
});

test('a daemon that went away shows as stopped at once, not as ready', () => {
  const v = statusView({ state: 'stopped', message: 'the completion daemon stopped (the daemon closed the connection); the next completion starts it again' }, undefined, true);
  assert.equal(v.text, '$(debug-disconnect) completiond');
  assert.doesNotMatch(v.tooltip, /ready/);
  assert.match(v.tooltip, /the next completion starts it again/);
});

test('busy spins; error is red with the message', () => {
  assert.match(statusView({ state: 'busy' }, undefined, true).text, /sync~spin/);
  const e = statusView({ state: 'error', message: 'CUDA out of memory' }, undefined, true);
  assert.equal(e.error, true);
  assert.match(e.tooltip, /CUDA out of memory/);
});

test('client states: starting, not found, stopped, disabled', () => {
  assert.match(statusView(undefined, 'starting', true).text, /loading~spin/);
  assert.equal(statusView(undefined, 'notFound', true).error, true);
  assert.match(statusView(undefined, 'notFound', true).tooltip, /not found/);
  assert.equal(statusView(undefined, 'stopped', true).error, true);
  assert.match(statusView({ state: 'ready' }, undefined, false).text, /circle-slash/);
});

test('latency formatting and metrics; a speed only once measured', () => {
  assert.equal(formatLatency(8.7), '9 ms');
  assert.equal(formatLatency(2500), '2.5 s');
  assert.equal(metrics({ alpha: 0.5 }), '');
  assert.equal(metrics({ latencyMs: Number.NaN }), '');
  assert.equal(metrics({ latencyMs: 20, tokensPerSecond: 0 }), '20 ms');
});

test('suggestion counts: in the tooltip when the status carries them, and from stats', () => {
  const suggestions = { shown: 5, accepted_full: 1, accepted_word: 2, accepted_line: 0, dismissed: 1 };
  const v = statusView({ state: 'ready', suggestions }, undefined, true);
  assert.match(v.tooltip, /suggestions: 5 shown, 3 accepted \(1 full, 2 word, 0 line\), 1 dismissed/);
  assert.deepEqual(suggestionCounts({ suggestions }), suggestions);
  assert.deepEqual(suggestionCounts({ lsp: { suggestions } }), suggestions);
  assert.equal(suggestionCounts({ requests: 1 }), undefined);
  assert.equal(suggestionSummary(undefined), '');
  const camel = { shown: 2, acceptedFull: 1, acceptedWord: 0, acceptedLine: 1, dismissed: 0 };
  assert.equal(suggestionSummary(camel), 'suggestions: 2 shown, 2 accepted (1 full, 0 word, 1 line), 0 dismissed');
});

test('a daemon serving other settings than this editor asks for is not shown as ready', () => {
  const v = statusView({ state: 'ready', modelMismatch: 'the daemon serves other settings than yours: model' }, undefined, true);
  assert.match(v.text, /warning/);
  assert.doesNotMatch(v.tooltip, /ready/);
  assert.match(v.tooltip, /other settings than yours/);
});

test('stats render as indented key: value lines', () => {
  const text = formatStats({ model: 'mini', requests: 3, alpha: 0.123456, cache: { hits: 2, bytes: 10 }, devices: ['cpu'] });
  assert.equal(text, 'model: mini\nrequests: 3\nalpha: 0.1235\ncache:\n  hits: 2\n  bytes: 10\ndevices: cpu');
  assert.equal(formatStats(null), '(no stats)');
  assert.equal(formatStats('plain'), 'plain');
});
