"""Which engine a request goes to, and what happens when it dies: the router policy (`policy.py`:
affinity, least-loaded placement, prefix-cache accounting), group dispatch over live engines
(`dispatch.py`), the batched, retried engine requests (`requests.py`), and a labelled SIMULATION
of engines' prefix caches that measures what affinity buys (`prefix_cache_sim.py`)."""
