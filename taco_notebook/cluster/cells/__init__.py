"""Running a cell or a script on a cluster's ranks: the engine-side calls, output, results and reports."""
