/**
 * The dialogs of the sidebar: asking for a number of engines, confirming a stop or a scale-down, and showing a
 * running cell's stacks (the hang autopsy).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { MAX_CLUSTER_SIZE, parseSize, scaleDownConfirmation, stopConfirmation } from './format';
import { IClusterModel } from './models';

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
