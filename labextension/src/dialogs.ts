/**
 * The dialogs of the sidebar: asking for a number of engines.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { MAX_CLUSTER_SIZE, parseSize } from './format';

/** A labelled, required number input (`input.taco-size-input`), with the last error under it. */
class SizeInputBody extends Widget implements Dialog.IBodyWidget<string> {
  private readonly _input: HTMLInputElement;

  constructor(label: string, initial: number, error: string | null) {
    super();
    this.addClass('taco-size-dialog');
    const labelNode = document.createElement('label');
    labelNode.textContent = label;
    this._input = document.createElement('input');
    this._input.type = 'number';
    this._input.className = 'taco-size-input jp-mod-styled';
    this._input.min = '1';
    this._input.max = String(MAX_CLUSTER_SIZE);
    this._input.step = '1';
    this._input.required = true;
    this._input.value = String(initial);
    this._input.setAttribute('aria-label', label);
    labelNode.appendChild(this._input);
    this.node.appendChild(labelNode);
    // The dialog disables its accept button while the input is :invalid; say why.
    const hint = document.createElement('p');
    hint.className = 'taco-size-hint';
    hint.textContent = `A whole number from 1 to ${MAX_CLUSTER_SIZE}.`;
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
}

/**
 * Ask for a number of engines; `null` when cancelled. An invalid entry reopens the dialog with the reason,
 * so what reaches the server is always a positive integer.
 */
export async function askSize(options: IAskSizeOptions): Promise<number | null> {
  let error: string | null = null;
  let initial = options.initial;
  for (;;) {
    const result = await showDialog({
      title: options.title,
      body: new SizeInputBody(options.label, initial, error),
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: options.acceptLabel })],
      focusNodeSelector: 'input.taco-size-input'
    });
    if (!result.button.accept || result.value === null) {
      return null;
    }
    const parsed = parseSize(result.value);
    if ('size' in parsed) {
      return parsed.size;
    }
    error = parsed.error;
    const typed = Number.parseInt(result.value, 10);
    initial = Number.isFinite(typed) && typed > 0 ? typed : options.initial;
  }
}

/** Ask before stopping a cluster that is in the middle of a run; `true` to go ahead. */
export async function confirmStopDuringRun(name: string, cellSnippet: string): Promise<boolean> {
  const result = await showDialog({
    title: `Stop cluster ${name}?`,
    body: `It is running a cell (${cellSnippet}); stopping it ends that run on every rank.`,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
  });
  return result.button.accept;
}
