"""The rollout side's plain logic: sample types (`types.py`), the rollout layers (`layers.py`), the
orchestration (`orchestrator.py`) over the bounded buffer (`buffer.py`, its prompt `ledger.py`,
deadline `schedule.py`, group `filters.py`, the short-rollout `bias.py` meter), and the batch
hand-out to trainer ranks (`handout.py`); one concept per subfolder: `tokens/` (tokenizers,
chat templates), `tito/` (the session store), `routing/` (engine choice, requests, retries),
`rewards/` (rewards, sandbox, judge) and `envs/` (built-in environments).
Imports only miles.core; actors wrap these classes."""
