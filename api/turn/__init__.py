"""A chat turn as one pipeline that owns its stream, whatever API formats its answer.

`/v1/chat/completions`, `/v1/sessions/{sid}/messages` and `/v1/responses` each parse their
request into a typed turn request (`request`: `ChatTurn`, `MessageTurn`, `ResponseTurn`,
`ConversationTurn`) and make one call, `respond.serve_turn(state, engine, request, ask, shape)`:

1. admit (`request.admit`): a generation slot on arrival, before any work, and who the turn runs
   as, read once (the user's erasure epoch, its tenant and prefix-cache salt);
2. resolve (`TurnRequest.resolve`): the session, the version the turn extends and its branch,
   the whole dialogue the prompt renders, and the limits checked once on it;
3. prepare (`pipeline.prepare`): vLLM validates the request once, the prompt continues the
   version's stored ids (`lead`, `truncate`) or renders the dialogue, `max_tokens` is fixed
   against the context;
4. run (`pipeline.run_turn`): generate → answer → commit, written once, as typed events
   (`Started`, `Delta`, `Answered`, `Done`; `Failed` in a stream).

A shape (`respond.Shape`, implemented in `api.shapes`) only formats those events: one JSON body
from `Done`, or a stream of every event.
"""
