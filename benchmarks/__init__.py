"""The benchmark harness: ``python -m benchmarks NAME [ARGS…]`` runs ``benchmarks/NAME.py``; figures in README.md."""
