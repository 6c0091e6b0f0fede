"""The token-in-token-out (TITO) session store: exact token ids for multi-turn chats (`store.py`,
composing `render.py`, `match.py`, `output_check.py`, `assistant.py`, `temperature.py` and the
session-less `one_turn.py`; its plain values in `turns.py`), each session's tree of token
checkpoints (`tree.py`), and the async interface the rollout layers talk to a session through,
with its in-process implementation (`client.py`). The session service and its HTTP front are the
top-level `sessions/` folder, which imports this one."""
