"""Text and token ids: tokenizers (`tokenizer.py`, the built-in `tiny_tokenizer.py`), chat templates
rendered without transformers (`chat_template.py`) and checked for append-only rendering
(`template_check.py`), chat messages (`messages.py`), tool-call and reasoning parsing
(`tool_parser.py`), and image placeholders (`vl_placeholders.py`)."""
