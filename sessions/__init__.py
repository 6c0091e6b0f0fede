"""The session service (TITO turns over the session store plus an engine call) and its
OpenAI-compatible HTTP front; the session actor (actors/session.py) and the rollout process serve them."""
