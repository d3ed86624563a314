"""Each rank's side of a cell, run in the engine process: the calls the notebook makes, the cell runner, the script
runner and the wrapper process that watches the engine."""
