"""Rewards: the built-in answer rewards (`builtin.py`), rule rewards chosen by name (`rules.py`),
the code-test reward (`code_tests.py`) and the sandbox it runs programs in (`sandbox.py`), the
judge pool's client (`judge.py`) and judge-scored rewards (`judge_rewards.py`), and the guard
every reward function runs behind (`guard.py`)."""
