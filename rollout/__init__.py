"""The rollout side's plain logic: samples, the TITO session store, the rollout layers,
router policy, buffer and ledger, rewards, filters and built-in environments.
Imports only miles.core; actors wrap these classes."""
