/**
 * Cursor rest: tell the server where the cursor has come to rest (`completiond/cursorRest`,
 * { textDocument: { uri }, position }), so that the daemon prefills the prompt there while the user
 * reads, and the first suggestion after a jump or a switch of editors comes sooner. Sent REST_MS after
 * the selection last changed or an editor became active, once per place, and only where suggestions
 * are on for the document's language. A hint only: the daemon warms on open and after edits anyway.
 */
import { Clock, Disposable, systemClock } from './host';

export const CURSOR_REST_METHOD = 'completiond/cursorRest';
export const REST_MS = 300;

/** Where the cursor is: the document (its uri as the language client sends it, its version) and an LSP position. */
export interface CursorPlace {
  uri: string;
  languageId: string;
  version: number;
  line: number;
  character: number;
}

export interface RestParams {
  textDocument: { uri: string };
  position: { line: number; character: number };
}

export class CursorRest implements Disposable {
  private timer: Disposable | undefined;
  private sent = '';

  /**
   * send: the notification to the running language client (dropped when none runs);
   * allowed: whether suggestions are on for a language now (snoozed or turned off: no hint either).
   */
  constructor(
    private readonly send: (params: RestParams) => void,
    private readonly allowed: (languageId: string) => boolean,
    private readonly clock: Clock = systemClock,
    private readonly delayMs = REST_MS,
  ) {}

  /** The cursor moved, or another editor became active (undefined: none, or not a text editor). */
  moved(place: CursorPlace | undefined): void {
    this.timer?.dispose();
    this.timer = undefined;
    if (place === undefined) return;
    this.timer = this.clock.setTimer(() => this.rested(place), this.delayMs);
  }

  private rested(place: CursorPlace): void {
    this.timer = undefined;
    const key = `${place.uri}@${place.version}:${place.line}:${place.character}`;
    if (key === this.sent || !this.allowed(place.languageId)) return;
    this.sent = key;
    this.send({ textDocument: { uri: place.uri }, position: { line: place.line, character: place.character } });
  }

  dispose(): void {
    this.timer?.dispose();
    this.timer = undefined;
  }
}
