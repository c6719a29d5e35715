"""What the `dss` command's groups share: the `--data-dir` and `--db-url` options, and loading
the settings (`DSS_*` and flags) with one line per invalid value and exit 2 instead of a
traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from api.settings import Settings, load_settings

DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Data directory (SQLite metadata, disk tier, master key)")
]
DbUrlOpt = Annotated[
    str | None, typer.Option("--db-url", help="SQLAlchemy URL, e.g. postgresql+psycopg://...")
]


def settings_or_exit(command: str, **overrides: Any) -> Settings:
    """The settings, or one line per invalid value on stderr and exit 2 (no traceback): a
    `DSS_*` variable or flag the operator can fix."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        for err in exc.errors():
            where = "DSS_" + "__".join(str(part) for part in err["loc"]).upper()
            typer.echo(f"{command}: invalid setting {where}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a DSS_* variable that does not parse (bad JSON, say)
        typer.echo(f"{command}: invalid setting: {exc}", err=True)
        raise typer.Exit(2) from None
