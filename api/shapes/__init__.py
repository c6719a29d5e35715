"""The wire shapes: OpenAI's Chat Completions and Responses requests, responses and streams
(`chat_completion`, `openai_responses`, `usage`), the fields honoured or refused
(`openai_fields`), and the pydantic schemas of every route (`schemas`). Apart from the turn
pipeline (`api.turn`), which calls a reply here to shape its answer."""
