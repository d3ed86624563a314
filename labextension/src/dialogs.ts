/**
 * The dialogs of the sidebar: asking for a number of engines, confirming a stop or a scale-down, showing a
 * running cell's stacks (the hang autopsy) and peeking into its ranks.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { MAX_CLUSTER_SIZE, parseSize, scaleDownConfirmation, stopConfirmation } from './format';
import { IClusterModel, IPeekResult } from './models';

/** A labelled, required number input (`input.taco-size-input`), with the last error under it. */
class SizeInputBody extends Widget implements Dialog.IBodyWidget<string> {
  private readonly _input: HTMLInputElement;

  constructor(label: string, initial: number, error: string | null, max: number) {
    super();
    this.addClass('taco-size-dialog');
    const labelNode = document.createElement('label');
    labelNode.textContent = label;
    this._input = document.createElement('input');
    this._input.type = 'number';
    this._input.className = 'taco-size-input jp-mod-styled';
    this._input.min = '1';
    this._input.max = String(max);
    this._input.step = '1';
    this._input.required = true;
    this._input.value = String(initial);
    this._input.setAttribute('aria-label', label);
    labelNode.appendChild(this._input);
    this.node.appendChild(labelNode);
    // The dialog disables its accept button while the input is :invalid; say why.
    const hint = document.createElement('p');
    hint.className = 'taco-size-hint';
    hint.textContent = `A whole number from 1 to ${max}.`;
    this.node.appendChild(hint);
    if (error) {
      const errorNode = document.createElement('p');
      errorNode.className = 'taco-size-error';
      errorNode.textContent = error;
      this.node.appendChild(errorNode);
    }
  }

  getValue(): string {
    return this._input.value;
  }
}

export interface IAskSizeOptions {
  title: string;
  label: string;
  initial: number;
  acceptLabel: string;
  /** The largest size accepted: the server's `max_ranks` (default {@link MAX_CLUSTER_SIZE}). */
  max?: number;
}

/**
 * Ask for a number of engines; `null` when cancelled. An invalid entry reopens the dialog with the reason,
 * so what reaches the server is always a positive integer.
 */
export async function askSize(options: IAskSizeOptions): Promise<number | null> {
  let error: string | null = null;
  let initial = options.initial;
  const max = options.max ?? MAX_CLUSTER_SIZE;
  for (;;) {
    const result = await showDialog({
      title: options.title,
      body: new SizeInputBody(options.label, Math.min(initial, max), error, max),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: options.acceptLabel })],
      focusNodeSelector: 'input.taco-size-input'
    });
    if (!result.button.accept || result.value === null) {
      return null;
    }
    const parsed = parseSize(result.value, max);
    if ('size' in parsed) {
      return parsed.size;
    }
    error = parsed.error;
    const typed = Number.parseInt(result.value, 10);
    initial = Number.isFinite(typed) && typed > 0 ? typed : options.initial;
  }
}

/** Ask before stopping (or removing a stale) cluster, saying what is lost; `true` to go ahead. */
export async function confirmStop(cluster: IClusterModel): Promise<boolean> {
  const text = stopConfirmation(cluster);
  const result = await showDialog({
    title: text.title,
    body: text.body,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: text.label })]
  });
  return result.button.accept;
}

/** Ask before scaling a cluster down to `size` engines; `true` to go ahead. */
export async function confirmScaleDown(cluster: IClusterModel, size: number): Promise<boolean> {
  const result = await showDialog({
    title: `Scale cluster ${cluster.name} down to ${size}?`,
    body: scaleDownConfirmation(cluster, size),
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Scale down' })]
  });
  return result.button.accept;
}

/** Show the hang autopsy of a cluster (`pre.taco-stacks-text` in the dialog): where each rank is, grouped. */
export async function showStacks(cluster: IClusterModel, text: string): Promise<void> {
  const body = new Widget();
  body.addClass('taco-stacks-dialog');
  const pre = document.createElement('pre');
  pre.className = 'taco-stacks-text';
  pre.textContent = text;
  body.node.appendChild(pre);
  await showDialog({
    title: `Where the ranks of ${cluster.name} are`,
    body,
    buttons: [Dialog.okButton({ label: 'Close' })]
  });
}

/** The example an empty peek input shows. */
export const PEEK_PLACEHOLDER = 'loss.item()';

/**
 * The peek dialog's body (`.taco-peek-dialog`): an expression input (`input.taco-peek-input`), its button
 * (`button.taco-peek-run`, Enter in the input does the same), the last answer's text (`pre.taco-peek-text`) and
 * the last failure, the server's message (`.taco-peek-error`). The dialog stays open between peeks.
 */
class PeekBody extends Widget {
  private readonly _input: HTMLInputElement;
  private readonly _run: HTMLButtonElement;
  private readonly _text: HTMLPreElement;
  private readonly _error: HTMLParagraphElement;
  private readonly _peek: (expr: string) => Promise<IPeekResult>;

  constructor(peek: (expr: string) => Promise<IPeekResult>) {
    super();
    this._peek = peek;
    this.addClass('taco-peek-dialog');
    const row = document.createElement('div');
    row.className = 'taco-peek-row';
    this._input = document.createElement('input');
    this._input.type = 'text';
    this._input.className = 'taco-peek-input jp-mod-styled';
    this._input.placeholder = PEEK_PLACEHOLDER;
    this._input.spellcheck = false;
    this._input.setAttribute('aria-label', 'Python expression to evaluate on every rank');
    this._run = document.createElement('button');
    this._run.className = 'taco-peek-run jp-Button jp-mod-styled jp-mod-accept';
    this._run.textContent = 'Peek';
    this._run.title = 'Evaluate the expression on every rank now (Enter)';
    this._run.addEventListener('click', () => void this.run());
    row.append(this._input, this._run);
    const hint = document.createElement('p');
    hint.className = 'taco-peek-hint';
    hint.textContent = "Evaluated in each rank's namespace while the cell runs; the cell is not stopped or waited for.";
    this._error = document.createElement('p');
    this._error.className = 'taco-peek-error';
    this._error.hidden = true;
    this._text = document.createElement('pre');
    this._text.className = 'taco-peek-text';
    this._text.hidden = true;
    this.node.append(row, hint, this._error, this._text);
  }

  /** Peek with the input's expression; a failure (400, 403, 409, no server) is shown here, not in a dialog. */
  async run(): Promise<void> {
    const expr = this._input.value.trim();
    if (!expr || this._run.disabled) {
      return;
    }
    this._run.disabled = true;
    this._run.textContent = 'Peeking…';
    try {
      const result = await this._peek(expr);
      this._text.textContent = result.text;
      this._text.hidden = false;
      this._error.hidden = true;
    } catch (error) {
      this._error.textContent = (error as Error).message ?? String(error);
      this._error.hidden = false;
    } finally {
      this._run.disabled = false;
      this._run.textContent = 'Peek';
    }
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    // The dialog listens for Enter on its own node, capturing, and closes when a text input has the focus:
    // listen above it so that Enter in the expression peeks instead.
    window.addEventListener('keydown', this._onKeydown, true);
  }

  protected onBeforeDetach(msg: Message): void {
    window.removeEventListener('keydown', this._onKeydown, true);
    super.onBeforeDetach(msg);
  }

  private readonly _onKeydown = (event: KeyboardEvent): void => {
    if (event.key === 'Enter' && event.target === this._input && !event.isComposing) {
      event.preventDefault();
      event.stopPropagation();
      void this.run();
    }
  };
}

/** Peek into the ranks of a cluster whose cell runs: an expression, evaluated on every rank, as often as asked. */
export async function showPeek(cluster: IClusterModel, peek: (expr: string) => Promise<IPeekResult>): Promise<void> {
  await showDialog({
    title: `Peek into the ranks of ${cluster.name}`,
    body: new PeekBody(peek),
    buttons: [Dialog.okButton({ label: 'Close' })],
    focusNodeSelector: 'input.taco-peek-input'
  });
}
