"""NOT SGLang: a simulation of SGLang 0.5.17's HTTP wire for CPU tests (see launch_server.py)."""
