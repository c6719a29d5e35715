"""The `dss` command: `serve`, `keys create|list|revoke|rotate-master` (`keys create --frontend`
registers a frontend too), `users erase|verify`, `model pull`.

Flags override the `DSS_*` environment (see `api.settings`). `keys` works on the database
directly (it does not need the server, and may run while the server runs), except
`keys rotate-master`, which runs only while no server owns the store. `users` opens the
store itself (the pages on disk are part of an erasure), so it needs the data directory free: with
a server running, erase through its API.
"""

from __future__ import annotations

import typer

from api.cli.keys import keys_app
from api.cli.model import model_app
from api.cli.serve import serve
from api.cli.users import users_app

main = typer.Typer(
    name="dss", help="DSS, the dialogue state store.", no_args_is_help=True, add_completion=False
)
main.command()(serve)
main.add_typer(keys_app, name="keys")
main.add_typer(users_app, name="users")
main.add_typer(model_app, name="model")
