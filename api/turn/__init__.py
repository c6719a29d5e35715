"""A chat turn as one pipeline, whatever API shapes its answer.

`/v1/chat/completions`, `/v1/sessions/{sid}/messages` and `/v1/responses` each parse their
request, make one call to `pipeline.serve_turn`, and shape the reply (`api.shapes`). The steps,
in order, each a module with one job:

1. admit (`admit`): a generation slot on arrival, before any work, and the user's erasure epoch;
2. resolve the target (`target`): the session, the version the turn extends and its branch,
   and the whole dialogue the prompt renders;
3. check the limits (`limits`), once, on that dialogue;
4. build the prompt (`prompt`): vLLM validates the request once, the prompt continues the
   version's stored ids (`dss.dialogue.continuation`) or renders the dialogue, `max_tokens` is fixed
   against the context;
5. generate (`generate`): the engine's stream, and each choice's answer (tool calls parsed);
6. commit (`commit`): each choice a version, all or nothing, after the last token.

A reply (`pipeline.Reply`, implemented in `api.shapes`) shapes the JSON body or drives the stream.
"""
