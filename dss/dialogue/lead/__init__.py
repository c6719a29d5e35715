"""Lead updates: a turn whose system prompt (or instructions) changed still extends its stored
version. The history's stored KV is kept exactly as computed, and the change is stated after it,
right before the new user message (docs/frontends.md, "Volatile system prompts").

`volatile` (which differences are volatile values), `policy` (modes, what a drift amounts to),
`update` (the update's wording), `view` (what the model saw of a version, stored beside the
client's messages), `match` (the stored version a drifted dialogue extends), `gate` (the quality
gate's rolling figures per frontend).
"""
