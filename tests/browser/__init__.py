"""Real-browser tests: a real JupyterLab server driven by Debian's chromium through Playwright."""
