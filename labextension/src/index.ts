/**
 * The taco-notebook JupyterLab plugin: the "TACO clusters" left sidebar.
 */

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';

import { ClusterManager } from './clusters';
import { ClusterAPI } from './request';
import { ClusterSidebar, SIDEBAR_ID } from './sidebar';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'taco-notebook:sidebar',
  description: 'A sidebar listing the MPI clusters of taco_notebook, to start, scale and stop them.',
  autoStart: true,
  optional: [INotebookTracker, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker | null,
    restorer: ILayoutRestorer | null
  ): void => {
    let sidebar: ClusterSidebar | null = null;
    const manager = new ClusterManager(
      new ClusterAPI(app.serviceManager.serverSettings),
      () => sidebar?.isVisible ?? false
    );
    sidebar = new ClusterSidebar({ manager, tracker, activate: id => app.shell.activateById(id) });
    app.shell.add(sidebar, 'left', { rank: 300, type: 'TACO clusters' });
    restorer?.add(sidebar, SIDEBAR_ID);
  }
};

export default plugin;
